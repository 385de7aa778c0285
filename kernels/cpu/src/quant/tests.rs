use super::*;

pub(crate) struct Rng(pub u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub(crate) fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    /// A finite half in ±[2^-8, 2^-1).
    fn half(&mut self) -> [u8; 2] {
        let r = self.next();
        let bits = ((r & 1) << 15) | (((r >> 1) % 7 + 7) << 10) | ((r >> 8) & 0x3ff);
        (bits as u16).to_le_bytes()
    }
}

/// Byte offsets of the f16 fields of a block.
fn half_fields(qt: QuantType) -> &'static [usize] {
    match qt {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K => &[0, 2],
        QuantType::Q6_K => &[208],
    }
}

pub(crate) fn random_matrix(qt: QuantType, rows: usize, blocks: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = qt.block_bytes();
    let mut data: Vec<u8> = (0..rows * blocks * bb).map(|_| rng.next() as u8).collect();
    for block in data.chunks_exact_mut(bb) {
        for &at in half_fields(qt) {
            block[at..at + 2].copy_from_slice(&rng.half());
        }
    }
    data
}

#[test]
fn half_conversion_matches_f16c() {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("f16c") {
        for h in 0..=u16::MAX {
            // SAFETY: f16c checked above.
            let hw = unsafe {
                use std::arch::x86_64::*;
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
            };
            let sw = f16_to_f32(h);
            assert!(
                hw.to_bits() == sw.to_bits() || (hw.is_nan() && sw.is_nan()),
                "{h:#x}"
            );
        }
    }
    assert_eq!(f16_to_f32(0x3c00), 1.0);
    assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
    assert_eq!(f16_to_f32(0xc000), -2.0);
}

#[test]
fn every_isa_gives_identical_results() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for qt in QuantType::ALL {
        for (m, n, blocks) in [
            (1, 1, 1),
            (1, 13, 2),
            (2, 7, 1),
            (3, 9, 2),
            (5, 17, 3),
            (9, 8, 1),
            (8, 5, 2),
            (17, 13, 2),
            (43, 6, 2),
        ] {
            let data = random_matrix(qt, n, blocks, &mut rng);
            let w = QuantMatrix::new(qt, &data, blocks * qt.block_bytes()).unwrap();
            let x: Vec<f32> = (0..m * w.k()).map(|_| rng.f32()).collect();
            let mut want = vec![0f32; m * n];
            matmul(&x, w, &mut want, 1, Isa::Scalar).unwrap();
            for &isa in available_isas() {
                for threads in [1, 3] {
                    let mut got = vec![f32::NAN; m * n];
                    matmul(&x, w, &mut got, threads, isa).unwrap();
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{qt:?} {isa:?} m={m} n={n}: {got:?} != {want:?}");
                }
            }
        }
    }
}

#[test]
fn extreme_codes_and_activations_give_identical_results() {
    // every code byte 0xff (the largest code of each format; Q8_0's -1) or 0x80 (Q8_0's -128)
    // against activations that all round to +127 or -127: the largest integer sums the SIMD
    // paths accumulate (a saturated int16 partial sum would differ from the scalar result)
    let mut rng = Rng(0x51_7cc1_b727_220a);
    for qt in QuantType::ALL {
        for code in [0xffu8, 0x80] {
            let (n, blocks, m) = (9, 3, 43); // 43 rows: tiles of eight in groups of four, two, one
            let mut data = vec![code; n * blocks * qt.block_bytes()];
            for block in data.chunks_exact_mut(qt.block_bytes()) {
                for &at in half_fields(qt) {
                    block[at..at + 2].copy_from_slice(&rng.half());
                }
            }
            let w = QuantMatrix::new(qt, &data, blocks * qt.block_bytes()).unwrap();
            for sign in [1.0f32, -1.0] {
                let x: Vec<f32> = (0..m * w.k())
                    .map(|i| sign * (1.0 + (i % 3) as f32 * 1e-3))
                    .collect();
                let mut want = vec![0f32; m * n];
                matmul(&x, w, &mut want, 1, Isa::Scalar).unwrap();
                for &isa in available_isas() {
                    let mut got = vec![f32::NAN; m * n];
                    matmul(&x, w, &mut got, 2, isa).unwrap();
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{qt:?} {isa:?} code {code:#x} sign {sign}: {got:?} != {want:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn simd_activation_quantization_equals_the_portable_one() {
    let mut rng = Rng(5);
    // ordinary blocks, an all-zero block, tiny and huge magnitudes, exact halves (ties)
    let mut x: Vec<f32> = (0..32 * 61).map(|_| rng.f32() * 3.0).collect();
    x[32..64].fill(0.0);
    for (i, v) in x[64..96].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 1e-30;
    }
    for (i, v) in x[96..128].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 1e30;
    }
    for (i, v) in x[128..160].iter_mut().enumerate() {
        *v = i as f32 - 15.5; // q = round(v * 127 / 15.5): several land on .5
    }
    x[160..192].fill(f32::MIN_POSITIVE / 4.0); // subnormal: 1 / scale overflows
    x[192..224].fill(0.0); // ... and with zeros (0 * inf is NaN) and a negative one
    x[192] = -1e-38;
    x[200] = 1e-38;
    x[224..256].fill(1.0);
    x[230] = f32::NAN; // a NaN input
    x[231] = -f32::NAN;
    let (blocks, n) = (x.len() / 32, x.len());
    let (mut q1, mut d1, mut s1) = (vec![0i8; n], vec![0f32; blocks], vec![0f32; blocks]);
    quantize_blocks_portable(&x, &mut q1, &mut d1, &mut s1);
    let (mut q2, mut d2, mut s2) = (vec![0i8; n], vec![0f32; blocks], vec![0f32; blocks]);
    quantize_blocks(&x, &mut q2, &mut d2, &mut s2);
    assert_eq!(q1, q2);
    assert!(
        q1.iter().all(|&q| q >= -127),
        "-128 would defeat the sign trick"
    );
    assert!(d1.iter().zip(&d2).all(|(a, b)| a.to_bits() == b.to_bits()));
    assert!(s1.iter().zip(&s2).all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn a_row_gives_the_same_bits_in_any_batch() {
    // decode runs one row, prefill and batched decode many: a request's numbers must not
    // depend on the rows it is multiplied with
    let mut rng = Rng(11);
    for qt in QuantType::ALL {
        let (m, n, blocks) = (35, 9, 3);
        let data = random_matrix(qt, n, blocks, &mut rng);
        let w = QuantMatrix::new(qt, &data, blocks * qt.block_bytes()).unwrap();
        let k = w.k();
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        for &isa in available_isas() {
            let mut batch = vec![0f32; m * n];
            matmul(&x, w, &mut batch, 2, isa).unwrap();
            for r in 0..m {
                let mut one = vec![0f32; n];
                matmul(&x[r * k..(r + 1) * k], w, &mut one, 1, isa).unwrap();
                let same = one
                    .iter()
                    .zip(&batch[r * n..(r + 1) * n])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{qt:?} {isa:?} row {r}");
            }
        }
    }
}

#[test]
fn matmul_on_the_int8_grid_equals_the_dequantized_product() {
    // Activations that are exactly int8 multiples of a power of two, with ±127 in every block,
    // quantize without error: the product must equal the float64 one of the dequantized rows
    // up to float32 rounding.
    let mut rng = Rng(7);
    for qt in QuantType::ALL {
        let (m, n, blocks) = (3, 5, 2);
        let data = random_matrix(qt, n, blocks, &mut rng);
        let w = QuantMatrix::new(qt, &data, blocks * qt.block_bytes()).unwrap();
        let k = w.k();
        let x: Vec<f32> = (0..m * k)
            .map(|i| {
                let q = if i % 32 == 5 {
                    127
                } else {
                    (rng.next() % 255) as i32 - 127
                };
                q as f32 / 64.0
            })
            .collect();
        let mut deq = vec![0f32; n * k];
        let rows: Vec<i64> = (0..n as i64).collect();
        dequantize_rows(w, &rows, &mut deq).unwrap();
        let mut got = vec![0f32; m * n];
        matmul(&x, w, &mut got, 1, best_isa()).unwrap();
        for i in 0..m {
            for j in 0..n {
                let (xr, wr) = (&x[i * k..(i + 1) * k], &deq[j * k..(j + 1) * k]);
                let want: f64 = xr.iter().zip(wr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let err = (got[i * n + j] as f64 - want).abs();
                assert!(
                    err <= 1e-5 * mag,
                    "{qt:?} [{i},{j}]: {} vs {want} (err {err}, mag {mag})",
                    got[i * n + j]
                );
            }
        }
    }
}

#[test]
fn shape_errors_are_reported() {
    let data = vec![0u8; 40];
    assert_eq!(
        QuantMatrix::new(QuantType::Q4_1, &data, 30).err(),
        Some(QuantError::RowBytes {
            qtype: QuantType::Q4_1,
            row_bytes: 30
        })
    );
    let w = QuantMatrix::new(QuantType::Q4_1, &data, 20).unwrap();
    assert_eq!((w.k(), w.rows()), (32, 2));
    let mut out = vec![0f32; 2];
    assert_eq!(
        matmul(&[0.0; 33], w, &mut out, 1, Isa::Scalar).err(),
        Some(QuantError::InnerDim { x_k: 33, w_k: 32 })
    );
    assert_eq!(
        dequantize_rows(w, &[2], &mut [0f32; 32]).err(),
        Some(QuantError::RowIndex { index: 2, rows: 2 })
    );
}

#[test]
fn interleaved_q4_0_gives_the_row_major_bits_and_rows() {
    let mut rng = Rng(0x1e7e_a5ed);
    let (rows, k) = (40, 256);
    let row_bytes = k / 32 * 18;
    let data = random_matrix(QuantType::Q4_0, rows, k / 32, &mut rng);
    let packed = interleave::interleave_q4_0(&data, row_bytes).unwrap();
    let plain = QuantMatrix::new(QuantType::Q4_0, &data, row_bytes).unwrap();
    let inter = QuantMatrix::new_interleaved(QuantType::Q4_0, &packed, row_bytes).unwrap();
    let all: Vec<i64> = (0..rows as i64).rev().collect();
    let (mut a, mut b) = (vec![0f32; rows * k], vec![0f32; rows * k]);
    dequantize_rows(plain, &all, &mut a).unwrap();
    dequantize_rows(inter, &all, &mut b).unwrap();
    assert_eq!(a, b);
    for m in [1, 2, 3, 4, 5, 8, 17] {
        let x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        for &isa in available_isas() {
            for threads in [1, 2] {
                let (mut want, mut got) = (vec![0f32; m * rows], vec![0f32; m * rows]);
                matmul(&x, plain, &mut want, threads, isa).unwrap();
                matmul(&x, inter, &mut got, threads, isa).unwrap();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "m {m} {isa:?} {threads} threads");
            }
        }
    }
}

#[test]
fn only_q4_0_in_whole_groups_of_eight_interleaves() {
    let mut rng = Rng(5);
    let q8 = random_matrix(QuantType::Q8_0, 8, 1, &mut rng);
    let err = QuantMatrix::new_interleaved(QuantType::Q8_0, &q8, 34)
        .err()
        .unwrap();
    assert_eq!(err.to_string(), "Q8_0 has no interleaved layout (Q4_0 has)");
    let q4 = random_matrix(QuantType::Q4_0, 12, 1, &mut rng);
    let err = interleave::interleave_q4_0(&q4, 18).unwrap_err();
    assert_eq!(
        err.to_string(),
        "interleaved rows has 12 elements, expected 16"
    );
}
