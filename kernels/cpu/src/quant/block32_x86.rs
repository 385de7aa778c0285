//! AVX2 and AVX-512 VNNI products of the 32-weight formats (arithmetic in `block32`'s module
//! doc). The 4- and 5-bit codes are unsigned and below 32, so AVX2's `maddubs` never saturates
//! (2 x 31 x 128 < 2^15); Q8_0's signed codes go through the sign trick. Both paths give the
//! exact int32 sums.

use std::arch::x86_64::*;

use super::blocks::QuantType;
use super::x86::{fifth_bits, half, nibbles, prefetch};
use super::ActRow;

/// A block at `p`: (32 unsigned codes, scale, min), as `block32::unpack`.
#[inline(always)]
unsafe fn unpack(qt: QuantType, p: *const u8) -> (__m256i, f32, f32) {
    let sc = half(p);
    match qt {
        QuantType::Q4_0 => (nibbles(p.add(2)), sc, -8.0 * sc),
        QuantType::Q4_1 => (nibbles(p.add(4)), sc, half(p.add(2))),
        QuantType::Q5_0 => (
            _mm256_or_si256(nibbles(p.add(6)), fifth_bits(p.add(2))),
            sc,
            -16.0 * sc,
        ),
        QuantType::Q5_1 => (
            _mm256_or_si256(nibbles(p.add(8)), fifth_bits(p.add(4))),
            sc,
            half(p.add(2)),
        ),
        QuantType::Q8_0 => (_mm256_loadu_si256(p.add(2) as *const __m256i), sc, 0.0),
        _ => unreachable!("not a 32-weight format"),
    }
}

/// `$f::<consts.., SIGNED>(args)` with SIGNED = whether `qt` is the signed format (Q8_0): the
/// kernels are compiled once per sign handling.
macro_rules! by_sign {
    ($qt:expr, $f:ident $(::<$($c:tt),*>)? ($($a:expr),*)) => {
        if $qt == QuantType::Q8_0 {
            $f::<$($($c,)*)? true>($($a),*)
        } else {
            $f::<$($($c,)*)? false>($($a),*)
        }
    };
}

/// acc + the eight int32 sums of four consecutive products w_i * x_i; `SIGNED`: w signed
/// (Q8_0), multiplied through the sign trick (|w| times x with w's sign; |w| <= 128 keeps
/// `maddubs` from saturating); else w unsigned.
#[inline(always)]
unsafe fn dot_add_w<const VNNI: bool, const SIGNED: bool>(
    acc: __m256i,
    w: __m256i,
    x: __m256i,
) -> __m256i {
    if SIGNED {
        dot_add::<VNNI>(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w))
    } else {
        dot_add::<VNNI>(acc, w, x)
    }
}

/// acc + the eight int32 sums of four consecutive products u_i * x_i (u unsigned).
#[inline(always)]
unsafe fn dot_add<const VNNI: bool>(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
    if VNNI {
        _mm256_dpbusd_epi32(acc, u, x)
    } else {
        let pairs = _mm256_maddubs_epi16(u, x);
        _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
    }
}

/// The sums of the eight lanes of each of four vectors.
#[inline(always)]
unsafe fn sum_lanes4(v: [__m256i; 4]) -> __m128i {
    let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
}

#[inline(always)]
unsafe fn row4_impl<const VNNI: bool, const SIGNED: bool>(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    a: &ActRow<'_>,
) -> [f32; 4] {
    let bb = qt.block_bytes();
    let mut acc = _mm_setzero_ps();
    for b in 0..wrows[0].len() / bb {
        let x = _mm256_loadu_si256(a.q.as_ptr().add(32 * b) as *const __m256i);
        let mut lanes = [_mm256_setzero_si256(); 4];
        let (mut sc, mut mn) = ([0f32; 4], [0f32; 4]);
        for c in 0..4 {
            let p = wrows[c].as_ptr().add(b * bb);
            prefetch(p);
            let (u, s, m) = unpack(qt, p);
            lanes[c] = dot_add_w::<VNNI, SIGNED>(_mm256_setzero_si256(), u, x);
            (sc[c], mn[c]) = (s, m);
        }
        let isum = _mm_cvtepi32_ps(sum_lanes4(lanes));
        let scale = _mm_mul_ps(
            _mm_loadu_ps(sc.as_ptr()),
            _mm_set1_ps(*a.d.get_unchecked(b)),
        );
        acc = _mm_fmadd_ps(scale, isum, acc);
        acc = _mm_fmadd_ps(
            _mm_loadu_ps(mn.as_ptr()),
            _mm_set1_ps(*a.s.get_unchecked(b)),
            acc,
        );
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// One tile of eight activation rows as `ActTiles::tile` gives it: (q, d, s).
pub(crate) type Tile<'a> = (&'a [i8], &'a [f32], &'a [f32]);

/// The eight int32 lanes of Σ_i u_i · x(i) over the eight four-byte groups i of a block,
/// on AVX2 without VNNI: `G` `maddubs` results are added as int16 before one `madd` widens
/// them, so a block costs 8 + 8 / G multiply instructions instead of 16 (the multiply ports
/// bound the tiled products). Exact: each int16 lane then holds 2G products of a code and an
/// int8 in -127..127, and G is what keeps them in range (`i16_group`).
#[inline(always)]
unsafe fn sum_i16_groups<const G: usize>(
    wu: &[__m256i; 8],
    x: impl Fn(usize) -> __m256i,
) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let mut isum = _mm256_setzero_si256();
    for g in 0..8 / G {
        // two chains of int16 adds, so the multiplies need not wait on one another's sums
        let mut s16 = [_mm256_setzero_si256(); 2];
        for j in 0..G {
            let i = g * G + j;
            s16[j % 2] = _mm256_add_epi16(s16[j % 2], _mm256_maddubs_epi16(wu[i], x(i)));
        }
        let s16 = _mm256_add_epi16(s16[0], s16[1]);
        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(s16, ones));
    }
    isum
}

/// How many `maddubs` results of a block fit one int16 lane exactly: a lane adds 2G products
/// code · x with |x| <= 127, so 2G · max|code| · 127 <= 32767: 4-bit codes (<= 15) 8, 5-bit
/// codes (<= 31) 4, Q8_0's magnitudes (<= 128) 1.
const fn i16_group(qt: QuantType) -> usize {
    match qt {
        QuantType::Q4_0 | QuantType::Q4_1 => 8,
        QuantType::Q5_0 | QuantType::Q5_1 => 4,
        _ => 1,
    }
}

#[inline(always)]
unsafe fn tiles_impl<
    const T: usize,
    const VNNI: bool,
    const SIGNED: bool,
    const I16_GROUP: usize,
>(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    tiles: &[Tile<'_>; T],
) -> [[[f32; 8]; T]; 4] {
    let bb = qt.block_bytes();
    let mut acc = [[_mm256_setzero_ps(); T]; 4];
    for b in 0..wrows[0].len() / bb {
        for c in 0..4 {
            let p = wrows[c].as_ptr().add(b * bb);
            prefetch(p);
            let (u, sc, mn) = unpack(qt, p);
            // codes 4i..4i + 4 in every lane, once for all the tiles
            let mut wi = [_mm256_setzero_si256(); 8];
            let mut wu = [_mm256_setzero_si256(); 8];
            for i in 0..8 {
                wi[i] = _mm256_permutevar8x32_epi32(u, _mm256_set1_epi32(i as i32));
                // the unsigned operand: |w| for the signed format (its sign goes onto x)
                wu[i] = if SIGNED {
                    _mm256_sign_epi8(wi[i], wi[i])
                } else {
                    wi[i]
                };
            }
            let (scale, min) = (_mm256_set1_ps(sc), _mm256_set1_ps(mn));
            for t in 0..T {
                let (q, d, s) = tiles[t];
                let xq = q.as_ptr().add(256 * b) as *const __m256i;
                let x = |i: usize| {
                    let x = _mm256_loadu_si256(xq.add(i));
                    if SIGNED {
                        _mm256_sign_epi8(x, wi[i])
                    } else {
                        x
                    }
                };
                let isum = if VNNI {
                    // two chains: eight dependent dot instructions would wait on each other
                    let mut isum = [_mm256_setzero_si256(); 2];
                    for i in 0..8 {
                        isum[i % 2] = dot_add::<VNNI>(isum[i % 2], wu[i], x(i));
                    }
                    _mm256_add_epi32(isum[0], isum[1])
                } else {
                    sum_i16_groups::<I16_GROUP>(&wu, x)
                };
                let (d8, s8) = (
                    _mm256_loadu_ps(d.as_ptr().add(8 * b)),
                    _mm256_loadu_ps(s.as_ptr().add(8 * b)),
                );
                acc[c][t] = _mm256_fmadd_ps(
                    _mm256_mul_ps(scale, d8),
                    _mm256_cvtepi32_ps(isum),
                    acc[c][t],
                );
                acc[c][t] = _mm256_fmadd_ps(min, s8, acc[c][t]);
            }
        }
    }
    let mut out = [[[0f32; 8]; T]; 4];
    for c in 0..4 {
        for t in 0..T {
            _mm256_storeu_ps(out[c][t].as_mut_ptr(), acc[c][t]);
        }
    }
    out
}

/// `tiles_impl` for two tiles at once with 512-bit vectors: sixteen activation rows per
/// register, half the dot instructions of two 256-bit tiles (the dot instructions bounded
/// prefill). Same arithmetic, lane for lane.
#[inline(always)]
unsafe fn tiles16_impl<const SIGNED: bool>(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    tiles: &[Tile<'_>; 2],
) -> [[[f32; 8]; 2]; 4] {
    let bb = qt.block_bytes();
    let mut acc = [_mm512_setzero_ps(); 4];
    let ([qa, da, sa], [qb, db, sb]) = (
        [
            tiles[0].0.as_ptr() as *const u8,
            tiles[0].1.as_ptr() as *const u8,
            tiles[0].2.as_ptr() as *const u8,
        ],
        [
            tiles[1].0.as_ptr() as *const u8,
            tiles[1].1.as_ptr() as *const u8,
            tiles[1].2.as_ptr() as *const u8,
        ],
    );
    // the two tiles' 32 bytes at `at` as one 64-byte vector (tile 0 low, tile 1 high)
    let pair = |a: *const u8, b: *const u8, at: usize| {
        let lo = _mm256_loadu_si256(a.add(at) as *const __m256i);
        let hi = _mm256_loadu_si256(b.add(at) as *const __m256i);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    };
    for b in 0..wrows[0].len() / bb {
        let mut x = [_mm512_setzero_si512(); 8];
        for (i, x) in x.iter_mut().enumerate() {
            *x = pair(qa, qb, 256 * b + 32 * i);
        }
        let d16 = _mm512_castsi512_ps(pair(da, db, 32 * b));
        let s16 = _mm512_castsi512_ps(pair(sa, sb, 32 * b));
        for c in 0..4 {
            let p = wrows[c].as_ptr().add(b * bb);
            prefetch(p);
            let (u, sc, mn) = unpack(qt, p);
            // four-byte groups broadcast from memory (load ports), not permuted (the shuffle
            // port, which the 512-bit dot instructions share)
            let mut codes = [0i32; 8];
            _mm256_storeu_si256(codes.as_mut_ptr() as *mut __m256i, u);
            let mut isum = [_mm512_setzero_si512(); 2];
            for i in 0..8 {
                // volatile: the compiler would turn the stores and loads back into shuffles
                let wi = _mm512_set1_epi32(std::ptr::read_volatile(codes.as_ptr().add(i)));
                let (wu, xi) = if SIGNED {
                    // AVX-512 has no sign instruction: x negated where w < 0 (where w == 0
                    // the product is 0 whatever x), |w| the unsigned operand
                    let neg = _mm512_movepi8_mask(wi);
                    let xi = _mm512_mask_sub_epi8(x[i], neg, _mm512_setzero_si512(), x[i]);
                    (_mm512_abs_epi8(wi), xi)
                } else {
                    (wi, x[i])
                };
                isum[i % 2] = _mm512_dpbusd_epi32(isum[i % 2], wu, xi);
            }
            let isum = _mm512_add_epi32(isum[0], isum[1]);
            let scale = _mm512_mul_ps(_mm512_set1_ps(sc), d16);
            acc[c] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(isum), acc[c]);
            acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(mn), s16, acc[c]);
        }
    }
    let mut out = [[[0f32; 8]; 2]; 4];
    for c in 0..4 {
        let mut lanes = [0f32; 16];
        _mm512_storeu_ps(lanes.as_mut_ptr(), acc[c]);
        out[c][0].copy_from_slice(&lanes[..8]);
        out[c][1].copy_from_slice(&lanes[8..]);
    }
    out
}

/// `tiles::<2>` on 512-bit vectors (`tiles16_impl`): the same results.
///
/// # Safety
/// As `tiles`, and the CPU must have AVX-512 F, BW, VL and VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(crate) unsafe fn tiles16(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    tiles: &[Tile<'_>; 2],
) -> [[[f32; 8]; 2]; 4] {
    by_sign!(qt, tiles16_impl(qt, wrows, tiles))
}

/// The products of four weight rows with one activation row.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C, and with `vnni` AVX-512 VNNI and VL; the weight rows
/// must be equally long and hold the activation row's k weights.
pub(crate) unsafe fn row4(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    a: &ActRow<'_>,
    vnni: bool,
) -> [f32; 4] {
    if vnni {
        row4_vnni(qt, wrows, a)
    } else {
        row4_avx2(qt, wrows, a)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row4_avx2(qt: QuantType, wrows: &[&[u8]; 4], a: &ActRow<'_>) -> [f32; 4] {
    by_sign!(qt, row4_impl::<false>(qt, wrows, a))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
unsafe fn row4_vnni(qt: QuantType, wrows: &[&[u8]; 4], a: &ActRow<'_>) -> [f32; 4] {
    by_sign!(qt, row4_impl::<true>(qt, wrows, a))
}

/// The products of four weight rows with T tiles of eight activation rows (`block32::ActTiles`
/// layout): `out[c][t][r]`. The T tiles share each weight block's decoding.
///
/// # Safety
/// As `row4`; each tile must hold as many blocks as each weight row.
pub(crate) unsafe fn tiles<const T: usize>(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    tiles: &[Tile<'_>; T],
    vnni: bool,
) -> [[[f32; 8]; T]; 4] {
    if vnni {
        tiles_vnni::<T>(qt, wrows, tiles)
    } else {
        tiles_avx2::<T>(qt, wrows, tiles)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tiles_avx2<const T: usize>(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    tiles: &[Tile<'_>; T],
) -> [[[f32; 8]; T]; 4] {
    const G4: usize = i16_group(QuantType::Q4_0);
    const G5: usize = i16_group(QuantType::Q5_0);
    const G8: usize = i16_group(QuantType::Q8_0);
    match qt {
        QuantType::Q4_0 | QuantType::Q4_1 => tiles_impl::<T, false, false, G4>(qt, wrows, tiles),
        QuantType::Q5_0 | QuantType::Q5_1 => tiles_impl::<T, false, false, G5>(qt, wrows, tiles),
        _ => tiles_impl::<T, false, true, G8>(qt, wrows, tiles),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
unsafe fn tiles_vnni<const T: usize>(
    qt: QuantType,
    wrows: &[&[u8]; 4],
    tiles: &[Tile<'_>; T],
) -> [[[f32; 8]; T]; 4] {
    // the group size is unused: the dot instruction sums into int32 itself
    if qt == QuantType::Q8_0 {
        tiles_impl::<T, true, true, 1>(qt, wrows, tiles)
    } else {
        tiles_impl::<T, true, false, 1>(qt, wrows, tiles)
    }
}
