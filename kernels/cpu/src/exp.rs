//! Branch-free single-precision `exp` that the compiler can vectorize, for softmax.
//!
//! Method (the textbook Cody-Waite scheme): write x = n ln2 + r with n = round(x / ln2) and
//! |r| <= ln2 / 2, ln2 split in a high part exact in float32 and a low correction; evaluate
//! e^r by its Taylor polynomial of degree 7 in Horner form (truncation error below
//! 0.35^8 / 8! = 5e-9 relative, under float32's half-ulp of 6e-8); scale by 2^n by building
//! the float's exponent bits. Inputs are clamped to [-87, 88] so 2^n stays a normal float:
//! results below e^-87 (1.6e-38) are returned as e^-87, which no softmax sum can notice.

const LOG2_E: f32 = std::f32::consts::LOG2_E;
// ln 2 = LN2_HI + LN2_LO, LN2_HI having few enough mantissa bits that n * LN2_HI is exact.
// Written out in full (clippy allowed): the decimal is the f32 value exactly, which is the point.
#[allow(clippy::excessive_precision)]
const LN2_HI: f32 = 0.693_145_751_953_125;
#[allow(clippy::excessive_precision)]
const LN2_LO: f32 = 1.428_606_765_330_187e-6;
// 1.5 * 2^23: adding and subtracting it rounds a float below 2^22 to the nearest integer.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// e^x for one float32, accurate to about 1 ulp for x in [-87, 88]; clamped outside.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// `exp` with its polynomial's multiply-adds as fused multiply-adds when FMA is true: for
/// code compiled with FMA enabled (as `exp` they would be a multiply and an add each; without
/// FMA hardware, `mul_add` is a slow library call).
#[inline(always)]
pub fn exp_with<const FMA: bool>(x: f32) -> f32 {
    let madd = |a: f32, b: f32, c: f32| if FMA { a.mul_add(b, c) } else { a * b + c };
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2_E + ROUND_MAGIC; // n sits in its low mantissa bits
    let n = shifted - ROUND_MAGIC;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = madd(p, r, c);
    }
    // 2^n from the integer bits rather than `n as i32`, whose saturating conversion keeps a
    // loop of exps from vectorizing (|n| <= 127 here, so the difference of the bits is n)
    let n_bits = shifted.to_bits().wrapping_sub(ROUND_MAGIC.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    p * scale
}

#[cfg(test)]
mod tests {
    use super::{exp, exp_with};

    #[test]
    fn matches_libm_within_two_ulp() {
        let mut x = -87.0f32;
        while x <= 88.0 {
            let want = x.exp();
            let ulp = f32::from_bits(want.to_bits() + 1) - want;
            for got in [exp(x), exp_with::<true>(x)] {
                assert!(
                    (got - want).abs() <= 2.0 * ulp,
                    "exp({x}) = {got}, libm {want}"
                );
            }
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp_with::<true>(0.0), 1.0);
    }

    #[test]
    fn clamps_out_of_range_inputs() {
        assert_eq!(exp(-1000.0), exp(-87.0));
        assert_eq!(exp(f32::NEG_INFINITY), exp(-87.0));
        assert_eq!(exp(1000.0), exp(88.0));
        assert!(exp(-87.0) > 0.0 && exp(-87.0) < 2e-38);
    }
}
