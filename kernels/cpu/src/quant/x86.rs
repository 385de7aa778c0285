//! AVX2 and AVX-512 VNNI paths of the K-quants' dot products (Q4_K, Q5_K, Q6_K; the 32-weight
//! formats run in `block32_x86`): the same arithmetic as `blocks::dot_rows`, eight int32 lanes
//! per 32 weights. Signed weights meet the unsigned operand of `maddubs` / `dpbusd` through the
//! sign trick (`|w|` and `sign(w) * x`); with |w| <= 128 and |x| <= 127 no pair of `maddubs`
//! saturates, so both instructions give the exact lane sums. Also the block helpers
//! `block32_x86` shares (half, nibbles, fifth bits, prefetch) and the AVX2 activation
//! quantizer.

use std::arch::x86_64::*;

use super::blocks::{self, QuantType, Unpacked};
use super::{reduce_lanes, ActRow};

#[inline(always)]
pub(crate) unsafe fn half(p: *const u8) -> f32 {
    let h = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// How far ahead of the block being decoded its weight row is fetched into cache, in bytes.
/// Decode streams every weight from memory once per step; without prefetching, each cache miss
/// stalled the decoding of a block (a one-row product of a cold matrix took the sum of its
/// compute and its memory time, 1.65x a warm one, on the 2-core test machine).
const PREFETCH_BYTES: usize = 1024;

/// Asks for the cache line `PREFETCH_BYTES` past `p` (no fault past the end of the weights).
#[inline(always)]
pub(crate) unsafe fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
}

/// 16 bytes of two 4-bit values each: low nibbles in bytes 0-15, high nibbles in 16-31.
#[inline(always)]
pub(crate) unsafe fn nibbles(p: *const u8) -> __m256i {
    let b = _mm_loadu_si128(p as *const __m128i);
    let mask = _mm_set1_epi8(0xf);
    let lo = _mm_and_si128(b, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    _mm256_set_m128i(hi, lo)
}

/// 0x10 in byte i where bit i of the little-endian u32 at `p` is set.
#[inline(always)]
pub(crate) unsafe fn fifth_bits(p: *const u8) -> __m256i {
    let qh = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
    let idx = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), idx);
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// A K-quant super-block into `u`: the weights decoded 32 at a time, the scales by
/// `blocks::k_scales`.
#[inline(always)]
unsafe fn unpack_k(qt: QuantType, b: &[u8], u: &mut Unpacked) {
    blocks::k_scales(qt, b, u);
    let p = b.as_ptr();
    let w = u.w.as_mut_ptr() as *mut __m256i;
    let load = |at: usize| _mm256_loadu_si256(p.add(at) as *const __m256i);
    let low4 = _mm256_set1_epi8(0xf);
    match qt {
        QuantType::Q4_K | QuantType::Q5_K => {
            let (qs_at, qh) = if qt == QuantType::Q5_K {
                (48, Some(load(16)))
            } else {
                (16, None)
            };
            for pair in 0..4 {
                let q = load(qs_at + 32 * pair);
                let mut lo = _mm256_and_si256(q, low4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
                if let Some(qh) = qh {
                    let fifth = |s: i32| {
                        let bit = _mm256_set1_epi8((1u8 << s) as i8);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
                    };
                    lo = _mm256_or_si256(lo, fifth(2 * pair as i32));
                    hi = _mm256_or_si256(hi, fifth(2 * pair as i32 + 1));
                }
                _mm256_storeu_si256(w.add(2 * pair), lo);
                _mm256_storeu_si256(w.add(2 * pair + 1), hi);
            }
        }
        QuantType::Q6_K => {
            let (two_bits, offset) = (_mm256_set1_epi8(0x30), _mm256_set1_epi8(32));
            for h in 0..2 {
                let (ql0, ql1, qh) = (load(64 * h), load(64 * h + 32), load(128 + 32 * h));
                let parts = [
                    (_mm256_and_si256(ql0, low4), _mm256_slli_epi16(qh, 4)),
                    (_mm256_and_si256(ql1, low4), _mm256_slli_epi16(qh, 2)),
                    (_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), qh),
                    (
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                        _mm256_srli_epi16(qh, 2),
                    ),
                ];
                for (g, (low, high)) in parts.into_iter().enumerate() {
                    let q = _mm256_or_si256(low, _mm256_and_si256(high, two_bits));
                    _mm256_storeu_si256(w.add(4 * h + g), _mm256_sub_epi8(q, offset));
                }
            }
        }
        _ => unreachable!("only K-quants have super-blocks"),
    }
}

/// Eight int32 sums of four consecutive products w_i * x_i; `UNSIGNED`: every w_i >= 0 (the
/// formats with a min), which needs no sign trick.
#[inline(always)]
unsafe fn lane_dot<const VNNI: bool, const UNSIGNED: bool>(w: __m256i, x: __m256i) -> __m256i {
    let (aw, sx) = if UNSIGNED {
        (w, x)
    } else {
        (_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
    };
    if VNNI {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx)
    } else {
        _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1))
    }
}

/// The dot products of C weight rows with R activation rows, `out[c][r]`: each weight block is
/// decoded once for the R rows and each activation block loaded once for the C weight rows;
/// the C x R accumulators are independent chains, so a one-row product (decode) is not bound
/// by the latency of one chain of fused multiply-adds.
#[inline(always)]
unsafe fn dot_tile_impl<const C: usize, const R: usize, const VNNI: bool>(
    qt: QuantType,
    wrows: &[&[u8]; C],
    rows: &[ActRow<'_>; R],
) -> [[f32; R]; C] {
    if qt.has_min() {
        dot_tile_typed::<C, R, VNNI, true>(qt, wrows, rows)
    } else {
        dot_tile_typed::<C, R, VNNI, false>(qt, wrows, rows)
    }
}

/// `dot_tile_impl` for the K-quants with (`HAS_MIN`: unsigned weights) or without a min.
#[inline(always)]
unsafe fn dot_tile_typed<const C: usize, const R: usize, const VNNI: bool, const HAS_MIN: bool>(
    qt: QuantType,
    wrows: &[&[u8]; C],
    rows: &[ActRow<'_>; R],
) -> [[f32; R]; C] {
    let mut acc = [[_mm256_setzero_ps(); R]; C];
    let mut summ = [[0f32; R]; C];
    let bb = qt.block_bytes();
    let nblocks = wrows[0].len() / bb;
    let mut u: [Unpacked; C] = [const { Unpacked::ZERO }; C];
    for sb in 0..nblocks {
        for c in 0..C {
            prefetch(wrows[c].as_ptr().add(sb * bb));
            unpack_k(qt, &wrows[c][sb * bb..(sb + 1) * bb], &mut u[c]);
        }
        for j in 0..8 {
            let b = sb * 8 + j;
            for r in 0..R {
                let a = &rows[r];
                let x = _mm256_loadu_si256(a.q.as_ptr().add(32 * b) as *const __m256i);
                let (d, s) = (_mm256_set1_ps(*a.d.get_unchecked(b)), *a.s.get_unchecked(b));
                for c in 0..C {
                    let w = _mm256_loadu_si256(u[c].w.as_ptr().add(32 * j) as *const __m256i);
                    let scale = _mm256_loadu_ps(u[c].scale[j].as_ptr());
                    let lane = _mm256_cvtepi32_ps(lane_dot::<VNNI, HAS_MIN>(w, x));
                    acc[c][r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, d), lane, acc[c][r]);
                    if HAS_MIN {
                        summ[c][r] = u[c].min[j].mul_add(s, summ[c][r]);
                    }
                }
            }
        }
    }
    let mut res = [[0f32; R]; C];
    for c in 0..C {
        for r in 0..R {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[c][r]);
            res[c][r] = reduce_lanes(&lanes) + summ[c][r];
        }
    }
    res
}

/// # Safety
/// The CPU must have AVX2, FMA and F16C; each row of `rows` must hold the k weights of each
/// row of `wrows`, and the rows of `wrows` must be equally long.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_tile_avx2<const C: usize, const R: usize>(
    qt: QuantType,
    wrows: &[&[u8]; C],
    rows: &[ActRow<'_>; R],
) -> [[f32; R]; C] {
    dot_tile_impl::<C, R, false>(qt, wrows, rows)
}

/// # Safety
/// As `dot_tile_avx2`, and the CPU must have AVX-512 VNNI and VL.
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
pub(crate) unsafe fn dot_tile_vnni<const C: usize, const R: usize>(
    qt: QuantType,
    wrows: &[&[u8]; C],
    rows: &[ActRow<'_>; R],
) -> [[f32; R]; C] {
    dot_tile_impl::<C, R, true>(qt, wrows, rows)
}

/// `quantize_blocks_portable` with AVX2, the same bits for every input: the block's max|x| is
/// exact in any order (NaN skipped, as `f32::max` does), the product and the round to
/// nearest-even are the scalar ones, a NaN product (0 times an overflowed 1 / scale, or a NaN
/// input) becomes 0 as Rust's cast makes it, and values beyond int8 clamp to +-127. A prefill's
/// activations are ~10^6 values a product: scalar, this took 4-5 ns a value.
///
/// # Safety
/// The CPU must have AVX2 and FMA; `q` as long as `x`, `d` and `s` one per 32 values.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn quantize_blocks_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    let nb = x.len() / 32;
    assert!(q.len() == x.len() && d.len() >= nb && s.len() >= nb);
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    // NaN lanes to 0: the portable max skips a NaN, and its cast turns NaN into 0
    let no_nan = |v: __m256| _mm256_and_ps(v, _mm256_cmp_ps::<_CMP_ORD_Q>(v, v));
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nb {
        let p = x.as_ptr().add(32 * b);
        let mut v = [_mm256_setzero_ps(); 4];
        for (i, v) in v.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(p.add(8 * i));
        }
        let a = |i: usize| no_nan(_mm256_and_ps(v[i], abs_mask));
        let mut m = _mm256_max_ps(_mm256_max_ps(a(0), a(1)), _mm256_max_ps(a(2), a(3)));
        m = _mm256_max_ps(m, _mm256_permute2f128_ps::<1>(m, m));
        m = _mm256_max_ps(m, _mm256_permute_ps::<0b0100_1110>(m));
        m = _mm256_max_ps(m, _mm256_permute_ps::<0b1011_0001>(m));
        let scale = _mm256_cvtss_f32(m) / 127.0;
        let inv = _mm256_set1_ps(if scale > 0.0 { 1.0 / scale } else { 0.0 });
        let mut qi = [_mm256_setzero_si256(); 4];
        for i in 0..4 {
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(no_nan(
                _mm256_mul_ps(v[i], inv),
            ));
            qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        let total = _mm256_add_epi32(
            _mm256_add_epi32(qi[0], qi[1]),
            _mm256_add_epi32(qi[2], qi[3]),
        );
        let t = _mm_add_epi32(
            _mm256_castsi256_si128(total),
            _mm256_extracti128_si256::<1>(total),
        );
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b0100_1110>(t));
        let t = _mm_add_epi32(t, _mm_shuffle_epi32::<0b1011_0001>(t));
        let sum = _mm_cvtsi128_si32(t);
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(qi[0], qi[1]),
            _mm256_packs_epi32(qi[2], qi[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        _mm256_storeu_si256(q.as_mut_ptr().add(32 * b) as *mut __m256i, bytes);
        d[b] = scale;
        s[b] = scale * sum as f32;
    }
}
