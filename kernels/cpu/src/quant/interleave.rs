//! Q4_0 weights with their rows interleaved eight at a time, for one-row products (decode) that
//! run about twice as fast on AVX2 from memory (four times from cache) as the row-major kernel.
//!
//! Layout: rows in groups of eight (a matrix of rows % 8 == 0); a group's blocks in order, each
//! block of the eight rows as 144 bytes: the eight fp16 scales (row order), then four chunks of
//! 32 bytes, chunk q holding bytes 4q..4q + 4 of each row's 16 code bytes (row order). A 32-byte
//! chunk then holds four codes' bytes of every row, so one load, two masks and one shift give
//! 64 codes, each of the eight 32-bit lanes one row's; the activation's four matching bytes are
//! broadcast to every lane. This is llama.cpp's idea for Q4_0 on AVX2 (ggml-cpu's repacked
//! `q4_0_8x8` GEMV); the layout and the kernel here are pyserve's own.
//!
//! The arithmetic is `block32`'s, in the same order: a block's 32 products summed exactly (as
//! int16 over eight `maddubs` results, |sum| <= 16 x 15 x 127 < 2^15, then widened), then
//! `fma(scale · d_x, sum, acc)` and `fma(-8 · scale, s_x, acc)` per block in block order, so the
//! bits equal the row-major paths' (tested).

use super::blocks::QuantType;
use super::{block32, ActRow, Isa, OutColumns, QuantActivations, QuantError, QuantMatrix};

/// Bytes of one block of eight interleaved rows.
const GROUP_BLOCK: usize = 8 * 18;

/// `data` ([rows, row_bytes] Q4_0, row-major) interleaved eight rows at a time. Errors unless
/// rows are whole blocks and a multiple of eight.
pub fn interleave_q4_0(data: &[u8], row_bytes: usize) -> Result<Vec<u8>, QuantError> {
    let w = QuantMatrix::new(QuantType::Q4_0, data, row_bytes)?;
    check_rows(w.rows())?;
    let kb = row_bytes / 18;
    let mut out = vec![0u8; data.len()];
    for g in 0..w.rows() / 8 {
        for b in 0..kb {
            let base = (g * kb + b) * GROUP_BLOCK;
            for r in 0..8 {
                let block = &data[(8 * g + r) * row_bytes + b * 18..][..18];
                out[base + 2 * r..base + 2 * r + 2].copy_from_slice(&block[..2]);
                for q in 0..4 {
                    let at = base + 16 + 32 * q + 4 * r;
                    out[at..at + 4].copy_from_slice(&block[2 + 4 * q..6 + 4 * q]);
                }
            }
        }
    }
    Ok(out)
}

pub(super) fn check_rows(rows: usize) -> Result<(), QuantError> {
    if !rows.is_multiple_of(8) {
        return Err(QuantError::Len {
            name: "interleaved rows",
            got: rows,
            want: rows.next_multiple_of(8),
        });
    }
    Ok(())
}

/// Row `r` of an interleaved matrix in the row-major layout (`row_bytes` bytes).
pub(super) fn row_major(w: &QuantMatrix<'_>, r: usize) -> Vec<u8> {
    let kb = w.row_bytes / 18;
    let (g, lane) = (r / 8, r % 8);
    let mut row = vec![0u8; w.row_bytes];
    for (b, block) in row.chunks_exact_mut(18).enumerate() {
        let base = (g * kb + b) * GROUP_BLOCK;
        block[..2].copy_from_slice(&w.data[base + 2 * lane..base + 2 * lane + 2]);
        for q in 0..4 {
            let at = base + 16 + 32 * q + 4 * lane;
            block[2 + 4 * q..6 + 4 * q].copy_from_slice(&w.data[at..at + 4]);
        }
    }
    row
}

/// out[:, cols] of out [m, n] for an interleaved Q4_0 `w`: each group of eight weight rows
/// against every activation row. `cols` starts at a multiple of eight and ends at one or at n.
pub(super) fn matmul_rows(
    act: &QuantActivations,
    w: QuantMatrix<'_>,
    cols: std::ops::Range<usize>,
    out: OutColumns,
    n: usize,
    isa: Isa,
) {
    debug_assert!(cols.start.is_multiple_of(8) && (cols.end.is_multiple_of(8) || cols.end == n));
    let (m, k) = (act.rows(), act.k);
    let kb = k / 32;
    for g in cols.start / 8..cols.end.div_ceil(8) {
        let group = &w.data[g * 8 * w.row_bytes..(g + 1) * 8 * w.row_bytes];
        let scalar_rows: Vec<Vec<u8>> = match isa {
            Isa::Scalar => (0..8).map(|c| row_major(&w, 8 * g + c)).collect(),
            _ => Vec::new(),
        };
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut r = 0;
        #[cfg(target_arch = "x86_64")]
        while isa != Isa::Scalar && r + ROWS <= m {
            let rows: [ActRow<'_>; ROWS] = std::array::from_fn(|i| act.row(r + i));
            // SAFETY: as gemv8_avx2's below, for each of the ROWS activation rows
            let got = unsafe { gemv8_rows_avx2(group, kb, &rows) };
            for (i, row) in got.iter().enumerate() {
                for (c, v) in row.iter().enumerate() {
                    // SAFETY: as below
                    unsafe { out.set((r + i) * n + 8 * g + c, *v) };
                }
            }
            r += ROWS;
        }
        for r in r..m {
            let a = act.row(r);
            let got: [f32; 8] = match isa {
                Isa::Scalar => {
                    std::array::from_fn(|c| block32::dot_row(QuantType::Q4_0, &scalar_rows[c], &a))
                }
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `matmul` checked that this CPU has AVX2 (every non-scalar Isa implies it);
                // `group` holds eight rows of kb blocks and `a` k = 32 kb activations.
                _ => unsafe { gemv8_avx2(group, kb, &a) },
                #[cfg(not(target_arch = "x86_64"))]
                _ => unreachable!("only the scalar path exists off x86-64"),
            };
            for (c, v) in got.iter().enumerate() {
                // SAFETY: r < m, 8g + c < n (n is a multiple of 8 for an interleaved matrix),
                // and these columns are this task's
                unsafe { out.set(r * n + 8 * g + c, *v) };
            }
        }
    }
}

/// Activation rows a multi-row call takes: each 32-byte load of weight codes, once unpacked,
/// feeds this many rows' products (a prefill's products, a mixture's experts with several
/// tokens), about 1.3x less work per row than one row at a time.
const ROWS: usize = 4;

/// `gemv8_avx2` for R activation rows at once: each row's eight sums by the same arithmetic in
/// the same order (so the same bits), the weight codes unpacked once for all R.
///
/// # Safety
/// As `gemv8_avx2`, for every row of `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv8_rows_avx2<const R: usize>(
    group: &[u8],
    kb: usize,
    a: &[ActRow<'_>; R],
) -> [[f32; 8]; R] {
    use std::arch::x86_64::*;
    debug_assert!(group.len() >= kb * GROUP_BLOCK && a.iter().all(|r| r.q.len() >= 32 * kb));
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); R];
    for b in 0..kb {
        let base = group.as_ptr().add(b * GROUP_BLOCK);
        super::x86::prefetch(base);
        let scales = _mm256_cvtph_ps(_mm_loadu_si128(base as *const __m128i));
        let mut sum16 = [_mm256_setzero_si256(); R];
        for q in 0..4 {
            let w = _mm256_loadu_si256(base.add(16 + 32 * q) as *const __m256i);
            let lo = _mm256_and_si256(w, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), mask);
            for (s16, row) in sum16.iter_mut().zip(a) {
                let x = row.q.as_ptr().add(32 * b);
                let x_lo = _mm256_set1_epi32((x.add(4 * q) as *const i32).read_unaligned());
                let x_hi = _mm256_set1_epi32((x.add(16 + 4 * q) as *const i32).read_unaligned());
                *s16 = _mm256_add_epi16(*s16, _mm256_maddubs_epi16(lo, x_lo));
                *s16 = _mm256_add_epi16(*s16, _mm256_maddubs_epi16(hi, x_hi));
            }
        }
        let mins = _mm256_mul_ps(scales, _mm256_set1_ps(-8.0));
        for ((acc, s16), row) in acc.iter_mut().zip(sum16).zip(a) {
            let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
            let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*row.d.get_unchecked(b)));
            *acc = _mm256_fmadd_ps(scale, sums, *acc);
            *acc = _mm256_fmadd_ps(mins, _mm256_set1_ps(*row.s.get_unchecked(b)), *acc);
        }
    }
    let mut out = [[0f32; 8]; R];
    for (o, acc) in out.iter_mut().zip(acc) {
        _mm256_storeu_ps(o.as_mut_ptr(), acc);
    }
    out
}

/// The products of one group of eight interleaved rows (kb blocks) with one activation row.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `group` must hold 8 · kb blocks and `a` kb blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv8_avx2(group: &[u8], kb: usize, a: &ActRow<'_>) -> [f32; 8] {
    use std::arch::x86_64::*;
    debug_assert!(group.len() >= kb * GROUP_BLOCK && a.q.len() >= 32 * kb);
    let mask = _mm256_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for b in 0..kb {
        let base = group.as_ptr().add(b * GROUP_BLOCK);
        super::x86::prefetch(base);
        let scales = _mm256_cvtph_ps(_mm_loadu_si128(base as *const __m128i));
        let x = a.q.as_ptr().add(32 * b);
        let mut sum16 = _mm256_setzero_si256();
        for q in 0..4 {
            let w = _mm256_loadu_si256(base.add(16 + 32 * q) as *const __m256i);
            let lo = _mm256_and_si256(w, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(w), mask);
            let x_lo = _mm256_set1_epi32((x.add(4 * q) as *const i32).read_unaligned());
            let x_hi = _mm256_set1_epi32((x.add(16 + 4 * q) as *const i32).read_unaligned());
            sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(lo, x_lo));
            sum16 = _mm256_add_epi16(sum16, _mm256_maddubs_epi16(hi, x_hi));
        }
        let sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(sum16, ones));
        let scale = _mm256_mul_ps(scales, _mm256_set1_ps(*a.d.get_unchecked(b)));
        acc = _mm256_fmadd_ps(scale, sums, acc);
        let mins = _mm256_mul_ps(scales, _mm256_set1_ps(-8.0));
        acc = _mm256_fmadd_ps(mins, _mm256_set1_ps(*a.s.get_unchecked(b)), acc);
    }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), acc);
    out
}
