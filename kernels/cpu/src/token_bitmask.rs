//! Grammar token masks (structured output): the logits of the tokens a grammar disallows
//! become -inf, read from a packed bitmask in xgrammar's layout (`allocate_token_bitmask`,
//! `GrammarMatcher.fill_next_token_bitmask`): bit j of int32 word w (least significant bit
//! first) allows token w * 32 + j; bits past the vocabulary are ignored.
//!
//! A grammar usually allows almost every token (free text inside a JSON string) or almost none
//! (between JSON values), so most words are all ones (nothing to do) or all zeros (32 stores of
//! -inf, no load). Mixed words go 8 logits (one byte of the word) at a time, the same way:
//! skip, store -inf, or, for a mixed byte only, load + one AVX2 shift + blend + store; so a
//! mask that disallows a few scattered tokens touches little more memory than those tokens'
//! cache lines. AVX2 is chosen at run time when the CPU has it; a portable path serves other
//! CPUs (and tests, which force it).

use std::sync::Mutex;

use crate::parallel::{run_tasks, threads_for};

/// Tokens one mask word covers.
pub const BITS_PER_WORD: usize = 32;

/// One masked row: the logits row it writes and its mask words.
type Job<'a> = (&'a mut [f32], &'a [i32]);

/// Which inner loop `apply_token_bitmask` ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskPath {
    /// AVX2 intrinsics (x86-64 CPUs that have AVX2).
    Avx2,
    /// Portable Rust, any CPU.
    Scalar,
}

impl MaskPath {
    /// The path for this CPU: AVX2 when `allow_simd` and the CPU has it, else scalar.
    pub fn detect(allow_simd: bool) -> MaskPath {
        #[cfg(target_arch = "x86_64")]
        if allow_simd && std::is_x86_feature_detected!("avx2") {
            return MaskPath::Avx2;
        }
        let _ = allow_simd;
        MaskPath::Scalar
    }

    pub fn name(self) -> &'static str {
        match self {
            MaskPath::Avx2 => "avx2",
            MaskPath::Scalar => "scalar",
        }
    }
}

/// A bad argument: lengths that do not fit, a row out of range, a repeated row. Nothing was
/// written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBitmaskError(pub String);

/// For each k: logits row `rows[k]` gets -inf at every token whose bit in mask row k
/// (`bitmask[k * words .. (k + 1) * words]`, words = ceil(vocab / 32)) is 0; other logits
/// keep their bits. Rows of `logits` not named in `rows` are untouched.
///
/// logits: the batch's rows, each `vocab` floats (separate slices, so rows of a wider tensor
/// work); bitmask: [rows.len(), words] int32 in xgrammar's layout; rows: distinct indices into
/// `logits`. Runs on up to `num_threads` threads (torch's OpenMP team when attached, see
/// `parallel`), AVX2 when `allow_simd` and the CPU has it. Returns the path it ran.
/// Errors (nothing written): a row of the wrong length, a bitmask of the wrong length, a row
/// index outside 0..logits.len() or repeated.
pub fn apply_token_bitmask(
    logits: Vec<&mut [f32]>,
    vocab: usize,
    bitmask: &[i32],
    rows: &[i32],
    allow_simd: bool,
    num_threads: usize,
) -> Result<MaskPath, TokenBitmaskError> {
    let path = MaskPath::detect(allow_simd);
    let words = vocab.div_ceil(BITS_PER_WORD);
    if let Some(bad) = logits.iter().position(|r| r.len() != vocab) {
        return Err(TokenBitmaskError(format!(
            "apply_token_bitmask_: logits row {bad} has {} floats, not vocab = {vocab}",
            logits[bad].len()
        )));
    }
    if bitmask.len() != rows.len() * words {
        return Err(TokenBitmaskError(format!(
            "apply_token_bitmask_: bitmask holds {} words, not len(rows) x ceil(vocab / 32) = {} x {words}",
            bitmask.len(),
            rows.len()
        )));
    }
    let batch = logits.len();
    // Taking each named row out of its slot checks range and distinctness in one pass, and
    // hands every job a row no other job can reach.
    let mut slots: Vec<Option<&mut [f32]>> = logits.into_iter().map(Some).collect();
    let mut jobs: Vec<Job<'_>> = Vec::with_capacity(rows.len());
    for (k, &row) in rows.iter().enumerate() {
        let slot = usize::try_from(row)
            .ok()
            .and_then(|r| slots.get_mut(r))
            .ok_or_else(|| {
                TokenBitmaskError(format!(
                    "apply_token_bitmask_: rows[{k}] = {row} is outside 0..{batch}"
                ))
            })?;
        let logits_row = slot.take().ok_or_else(|| {
            TokenBitmaskError(format!(
                "apply_token_bitmask_: row {row} appears twice in rows"
            ))
        })?;
        jobs.push((logits_row, &bitmask[k * words..(k + 1) * words]));
    }
    if jobs.is_empty() || vocab == 0 {
        return Ok(path);
    }
    // Sized by the worst case (every word mixed): a mostly-allowed mask finishes sooner, but
    // which it is shows only after reading it.
    let threads = threads_for(jobs.len() * vocab, num_threads).min(jobs.len());
    let per = jobs.len().div_ceil(threads);
    let chunks: Vec<Mutex<&mut [Job<'_>]>> = jobs.chunks_mut(per).map(Mutex::new).collect();
    run_tasks(chunks.len(), &|i| {
        let mut chunk = chunks[i].lock().unwrap();
        for (logits_row, mask_row) in chunk.iter_mut() {
            mask_one_row(path, logits_row, mask_row);
        }
    });
    Ok(path)
}

fn mask_one_row(path: MaskPath, logits: &mut [f32], mask: &[i32]) {
    assert_eq!(mask.len(), logits.len().div_ceil(BITS_PER_WORD));
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `MaskPath::detect` returns Avx2 only when the CPU has AVX2.
        MaskPath::Avx2 => unsafe { mask_row_avx2(logits, mask) },
        _ => mask_row_scalar(logits, mask),
    }
}

/// The portable loop; also the tail (a last word covering fewer than 32 tokens) of the AVX2
/// one. `mask` holds ceil(logits.len() / 32) words.
fn mask_row_scalar(logits: &mut [f32], mask: &[i32]) {
    for (chunk, &word) in logits.chunks_mut(BITS_PER_WORD).zip(mask) {
        match word {
            -1 => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            // Mixed: 8 tokens at a time, skipping (or filling) the groups a byte of the word
            // settles, as the AVX2 loop does.
            _ => {
                for (g, group) in chunk.chunks_mut(8).enumerate() {
                    match (word as u32 >> (8 * g)) & 0xFF {
                        0xFF => {}
                        0 => group.fill(f32::NEG_INFINITY),
                        byte => {
                            for (j, x) in group.iter_mut().enumerate() {
                                // a select, not a branch, so the compiler may vectorize it
                                *x = if (byte >> j) & 1 == 0 {
                                    f32::NEG_INFINITY
                                } else {
                                    *x
                                };
                            }
                        }
                    }
                }
            }
        }
    }
}

/// # Safety
/// The CPU must have AVX2; `mask` holds ceil(logits.len() / 32) words.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn mask_row_avx2(logits: &mut [f32], mask: &[i32]) {
    use std::arch::x86_64::*;
    let full = logits.len() / BITS_PER_WORD;
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    // Lane i of the 8-float group g tests bit 8g + i: shifting that bit into the sign bit lets
    // blendv read it directly (blendv picks by sign bit), one shift + blend per 8 logits.
    let lane_shift = _mm256_setr_epi32(31, 30, 29, 28, 27, 26, 25, 24);
    let shifts = [
        lane_shift,
        _mm256_sub_epi32(lane_shift, _mm256_set1_epi32(8)),
        _mm256_sub_epi32(lane_shift, _mm256_set1_epi32(16)),
        _mm256_sub_epi32(lane_shift, _mm256_set1_epi32(24)),
    ];
    let base = logits.as_mut_ptr();
    for (w, &word) in mask[..full].iter().enumerate() {
        if word == -1 {
            continue;
        }
        // SAFETY: w < full, so the 32 floats at w * 32 lie inside logits.
        let p = base.add(w * BITS_PER_WORD);
        if word == 0 {
            for g in 0..4 {
                _mm256_storeu_ps(p.add(8 * g), neg_inf);
            }
            continue;
        }
        let bits = _mm256_set1_epi32(word);
        for (g, &shift) in shifts.iter().enumerate() {
            let byte = (word as u32 >> (8 * g)) & 0xFF;
            if byte == 0xFF {
                continue;
            }
            let q = p.add(8 * g);
            if byte == 0 {
                _mm256_storeu_ps(q, neg_inf);
                continue;
            }
            let allowed = _mm256_castsi256_ps(_mm256_sllv_epi32(bits, shift));
            _mm256_storeu_ps(q, _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(q), allowed));
        }
    }
    mask_row_scalar(&mut logits[full * BITS_PER_WORD..], &mask[full..]);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64: deterministic test data without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Mask words of every kind: all ones, all zeros, one bit, bytes of all ones / all zeros /
    /// mixed (the 8-token groups the kernel settles byte by byte), random.
    fn random_mask(rng: &mut Rng, len: usize) -> Vec<i32> {
        (0..len)
            .map(|_| match rng.next() % 5 {
                0 => -1,
                1 => 0,
                2 => 1 << (rng.next() % 32),
                3 => (0..4).fold(0u32, |w, g| {
                    let byte = [0x00, 0xFF, rng.next() as u32 & 0xFF][(rng.next() % 3) as usize];
                    w | byte << (8 * g)
                }) as i32,
                _ => rng.next() as i32,
            })
            .collect()
    }

    /// Bit by bit, as the layout is defined.
    fn naive(logits: &mut [f32], vocab: usize, bitmask: &[i32], rows: &[i32]) {
        let words = vocab.div_ceil(32);
        for (k, &row) in rows.iter().enumerate() {
            for t in 0..vocab {
                if (bitmask[k * words + t / 32] >> (t % 32)) & 1 == 0 {
                    logits[row as usize * vocab + t] = f32::NEG_INFINITY;
                }
            }
        }
    }

    fn run(
        logits: &mut [f32],
        vocab: usize,
        bitmask: &[i32],
        rows: &[i32],
        simd: bool,
        threads: usize,
    ) -> Result<MaskPath, TokenBitmaskError> {
        let row_slices: Vec<&mut [f32]> = if vocab == 0 {
            Vec::new()
        } else {
            logits.chunks_mut(vocab).collect()
        };
        apply_token_bitmask(row_slices, vocab, bitmask, rows, simd, threads)
    }

    #[test]
    fn both_paths_match_the_bitwise_definition() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        // 40000 x 3 rows is enough work to split over threads
        for vocab in [1usize, 31, 32, 33, 64, 100, 1000, 4099, 40000] {
            for (batch, rows) in [
                (4, vec![2, 0]),
                (3, vec![0, 1, 2]),
                (5, vec![]),
                (6, vec![5]),
            ] {
                let bitmask = random_mask(&mut rng, rows.len() * vocab.div_ceil(32));
                let logits: Vec<f32> = (0..batch * vocab)
                    .map(|_| (rng.next() % 2001) as f32 / 100.0 - 10.0)
                    .collect();
                let mut want = logits.clone();
                naive(&mut want, vocab, &bitmask, &rows);
                for (simd, threads) in [(true, 1), (false, 1), (true, 3), (false, 2)] {
                    let mut got = logits.clone();
                    let path = run(&mut got, vocab, &bitmask, &rows, simd, threads).unwrap();
                    if !simd {
                        assert_eq!(path, MaskPath::Scalar);
                    }
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "vocab {vocab} rows {rows:?} simd {simd}");
                }
            }
        }
    }

    #[test]
    fn avx2_is_chosen_when_the_cpu_has_it() {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            assert_eq!(MaskPath::detect(true), MaskPath::Avx2);
        }
        assert_eq!(MaskPath::detect(false), MaskPath::Scalar);
    }

    #[test]
    fn bad_arguments_write_nothing() {
        let vocab = 40;
        let mut logits = vec![1.5f32; 3 * vocab];
        let zeros = vec![0i32; 2 * 2];
        let err = |r: Result<MaskPath, TokenBitmaskError>| r.unwrap_err().0;
        assert_eq!(
            err(run(&mut logits, vocab, &zeros, &[0, 3], true, 1)),
            "apply_token_bitmask_: rows[1] = 3 is outside 0..3"
        );
        assert_eq!(
            err(run(&mut logits, vocab, &zeros, &[-1, 0], true, 1)),
            "apply_token_bitmask_: rows[0] = -1 is outside 0..3"
        );
        assert_eq!(
            err(run(&mut logits, vocab, &zeros, &[1, 1], true, 1)),
            "apply_token_bitmask_: row 1 appears twice in rows"
        );
        assert!(err(run(&mut logits, vocab, &zeros[..3], &[0, 1], true, 1)).contains("3 words"));
        assert!(logits.iter().all(|&x| x == 1.5));
    }
}
