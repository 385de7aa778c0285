use super::*;
use crate::quant::tests::{random_matrix, Rng};
use crate::quant::QuantType;

const H: usize = 64;
const I: usize = 40;
const E: usize = 6;
const K: usize = 2;

fn shape(num_experts: usize, expert_start: usize) -> MoeShape {
    MoeShape {
        hidden: H,
        inter: I,
        num_experts,
        expert_start,
        total_experts: E,
        top_k: K,
    }
}

/// T tokens' activations, distinct expert ids per token and routing weights.
fn routing(t: usize, rng: &mut Rng) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let x = (0..t * H).map(|_| rng.f32()).collect();
    let mut ids = Vec::new();
    for _ in 0..t {
        let first = (rng.next() % E as u64) as i32;
        let second = (first + 1 + (rng.next() % (E as u64 - 1)) as i32) % E as i32;
        ids.extend([first, second]);
    }
    let w = (0..t * K).map(|_| rng.f32().abs()).collect();
    (x, ids, w)
}

fn run(
    x: &[f32],
    ids: &[i32],
    w: &[f32],
    experts: ExpertWeights<'_>,
    s: MoeShape,
    threads: usize,
) -> Vec<f32> {
    let mut out = vec![f32::NAN; x.len()];
    fused_experts(x, ids, w, experts, s, &mut out, threads, quant::best_isa()).unwrap();
    out
}

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

#[test]
fn float32_experts_equal_the_f64_formula() {
    let mut rng = Rng(7);
    let gate_up: Vec<f32> = (0..E * 2 * I * H).map(|_| rng.f32() * 0.2).collect();
    let down: Vec<f32> = (0..E * H * I).map(|_| rng.f32() * 0.2).collect();
    let (x, ids, w) = routing(5, &mut rng);
    let out = run(
        &x,
        &ids,
        &w,
        ExpertWeights::F32 {
            gate_up: &gate_up,
            down: &down,
        },
        shape(E, 0),
        2,
    );
    for t in 0..5 {
        let mut want = vec![0f64; H];
        for j in 0..K {
            let e = ids[t * K + j] as usize;
            let dot = |row: &[f32]| {
                (0..H)
                    .map(|c| row[c] as f64 * x[t * H + c] as f64)
                    .sum::<f64>()
            };
            let act: Vec<f64> = (0..I)
                .map(|r| {
                    let g = dot(&gate_up[(e * 2 * I + r) * H..][..H]);
                    let u = dot(&gate_up[(e * 2 * I + I + r) * H..][..H]);
                    silu(g) * u
                })
                .collect();
            for (o, want) in want.iter_mut().enumerate() {
                let row = &down[(e * H + o) * I..][..I];
                *want += w[t * K + j] as f64 * (0..I).map(|r| row[r] as f64 * act[r]).sum::<f64>();
            }
        }
        for o in 0..H {
            let got = out[t * H + o] as f64;
            assert!(
                (got - want[o]).abs() <= 1e-5 * (1.0 + want[o].abs()),
                "token {t} [{o}]: {got} vs {}",
                want[o]
            );
        }
    }
}

#[test]
fn quantized_experts_are_the_dense_kernels_composed() {
    // quantized rows are whole blocks of 32: inter 32
    let mut rng = Rng(11);
    let (h, i) = (64, 32);
    for qt in [QuantType::Q4_0, QuantType::Q8_0, QuantType::Q5_1] {
        let gate_up = random_matrix(qt, E * 2 * i, h / 32, &mut rng);
        let down = random_matrix(qt, E * h, i / 32, &mut rng);
        let gu = QuantMatrix::new(qt, &gate_up, h / 32 * qt.block_bytes()).unwrap();
        let dn = QuantMatrix::new(qt, &down, i / 32 * qt.block_bytes()).unwrap();
        let s = MoeShape {
            hidden: h,
            inter: i,
            ..shape(E, 0)
        };
        let (x, ids, w) = routing(4, &mut rng);
        let out = run(
            &x,
            &ids,
            &w,
            ExpertWeights::Quant {
                gate_up: gu,
                down: dn,
            },
            s,
            2,
        );
        let isa = quant::best_isa();
        for t in 0..4 {
            let mut want = vec![0f32; h];
            let mut order: Vec<usize> = (0..K).collect();
            order.sort_by_key(|&j| ids[t * K + j]);
            for j in order {
                let e = ids[t * K + j] as usize;
                let rb = gu.row_bytes;
                let gu_e = QuantMatrix::new(qt, &gate_up[e * 2 * i * rb..(e + 1) * 2 * i * rb], rb)
                    .unwrap();
                let rb = dn.row_bytes;
                let dn_e = QuantMatrix::new(qt, &down[e * h * rb..(e + 1) * h * rb], rb).unwrap();
                let mut g = vec![0f32; 2 * i];
                quant::matmul(&x[t * h..(t + 1) * h], gu_e, &mut g, 1, isa).unwrap();
                let mut a = vec![0f32; i];
                activation::silu_and_mul(&g, &mut a, i, 1);
                let mut y = vec![0f32; h];
                quant::matmul(&a, dn_e, &mut y, 1, isa).unwrap();
                add_scaled(&mut want, &y, w[t * K + j]);
            }
            let got = &out[t * h..(t + 1) * h];
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{qt:?} token {t}"
            );
        }
    }
}

#[test]
fn a_token_gives_the_same_bits_in_any_batch_and_thread_count() {
    let mut rng = Rng(3);
    let gate_up: Vec<f32> = (0..E * 2 * I * H).map(|_| rng.f32()).collect();
    let down: Vec<f32> = (0..E * H * I).map(|_| rng.f32()).collect();
    let (x, ids, w) = routing(24, &mut rng);
    let f32w = ExpertWeights::F32 {
        gate_up: &gate_up,
        down: &down,
    };
    let s = shape(E, 0);
    each_token_alone_equals_the_batch(&x, &ids, &w, f32w, s, "float32");
    // K-quants need rows of whole 256-blocks: hidden 256, inter 256
    let (h, i) = (256, 256);
    let qt = QuantType::Q4_K;
    let gate_up = random_matrix(qt, E * 2 * i, 1, &mut rng);
    let down = random_matrix(qt, E * h, 1, &mut rng);
    let qw = ExpertWeights::Quant {
        gate_up: QuantMatrix::new(qt, &gate_up, qt.block_bytes()).unwrap(),
        down: QuantMatrix::new(qt, &down, qt.block_bytes()).unwrap(),
    };
    let s = MoeShape {
        hidden: h,
        inter: i,
        ..shape(E, 0)
    };
    let x: Vec<f32> = (0..24 * h).map(|_| rng.f32()).collect();
    each_token_alone_equals_the_batch(&x, &ids, &w, qw, s, "Q4_K");
}

#[test]
fn router_logits_are_the_same_bits_alone_and_in_a_batch() {
    let mut rng = Rng(13);
    let gate: Vec<f32> = (0..E * H).map(|_| rng.f32()).collect();
    let x: Vec<f32> = (0..9 * H).map(|_| rng.f32()).collect();
    let mut all = vec![0f32; 9 * E];
    router_logits(&x, &gate, H, &mut all, 2).unwrap();
    for t in 0..9 {
        let mut one = vec![0f32; E];
        router_logits(&x[t * H..(t + 1) * H], &gate, H, &mut one, 1).unwrap();
        assert_eq!(bits(&one), bits(&all[t * E..(t + 1) * E]), "token {t}");
        for e in 0..E {
            let want: f64 = (0..H)
                .map(|c| x[t * H + c] as f64 * gate[e * H + c] as f64)
                .sum();
            assert!((one[e] as f64 - want).abs() < 1e-5, "{} vs {want}", one[e]);
        }
    }
}

/// Tokens 0, 9 and 23 of the 24 run alone (one thread) give their rows of the whole batch
/// (two threads), bit for bit.
fn each_token_alone_equals_the_batch(
    x: &[f32],
    ids: &[i32],
    w: &[f32],
    experts: ExpertWeights<'_>,
    s: MoeShape,
    what: &str,
) {
    let h = s.hidden;
    let whole = run(x, ids, w, experts, s, 2);
    for t in [0, 9, 23] {
        let one = |v: &[f32], n: usize| v[t * n..(t + 1) * n].to_vec();
        let ids_t: Vec<i32> = ids[t * K..(t + 1) * K].to_vec();
        let alone = run(&one(x, h), &ids_t, &one(w, K), experts, s, 1);
        assert_eq!(
            bits(&alone),
            bits(&whole[t * h..(t + 1) * h]),
            "{what} token {t}"
        );
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn expert_parallel_halves_sum_to_the_whole() {
    let mut rng = Rng(5);
    let gate_up: Vec<f32> = (0..E * 2 * I * H).map(|_| rng.f32()).collect();
    let down: Vec<f32> = (0..E * H * I).map(|_| rng.f32()).collect();
    let (x, ids, w) = routing(7, &mut rng);
    let whole = run(
        &x,
        &ids,
        &w,
        ExpertWeights::F32 {
            gate_up: &gate_up,
            down: &down,
        },
        shape(E, 0),
        2,
    );
    let half = E / 2;
    let (gu, dn) = (2 * I * H, H * I);
    let lo = ExpertWeights::F32 {
        gate_up: &gate_up[..half * gu],
        down: &down[..half * dn],
    };
    let hi = ExpertWeights::F32 {
        gate_up: &gate_up[half * gu..],
        down: &down[half * dn..],
    };
    let a = run(&x, &ids, &w, lo, shape(half, 0), 2);
    let b = run(&x, &ids, &w, hi, shape(half, half), 2);
    for (o, (want, (a, b))) in whole.iter().zip(a.iter().zip(&b)).enumerate() {
        assert!(
            (a + b - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "[{o}] {} vs {want}",
            a + b
        );
    }
}

#[test]
fn bad_ids_and_shapes_are_errors_and_nothing_is_written() {
    let mut rng = Rng(9);
    let gate_up = vec![0f32; E * 2 * I * H];
    let down = vec![0f32; E * H * I];
    let f32w = ExpertWeights::F32 {
        gate_up: &gate_up,
        down: &down,
    };
    let (x, mut ids, w) = routing(2, &mut rng);
    ids[3] = E as i32;
    let mut out = vec![7f32; x.len()];
    let err = fused_experts(&x, &ids, &w, f32w, shape(E, 0), &mut out, 1, Isa::Scalar).unwrap_err();
    assert_eq!(
        err.to_string(),
        "expert id 6 is outside the model's experts"
    );
    ids[3] = 0;
    let err = fused_experts(
        &x,
        &ids[..3],
        &w,
        f32w,
        shape(E, 0),
        &mut out,
        1,
        Isa::Scalar,
    )
    .unwrap_err();
    assert!(matches!(err, MoeError::Shape(_)), "{err}");
    let short = ExpertWeights::F32 {
        gate_up: &gate_up[1..],
        down: &down,
    };
    let err =
        fused_experts(&x, &ids, &w, short, shape(E, 0), &mut out, 1, Isa::Scalar).unwrap_err();
    assert!(err.to_string().starts_with("moe: gate_up has"), "{err}");
    assert!(out.iter().all(|&v| v == 7.0));
}

#[test]
fn interleaved_q4_0_experts_give_the_row_major_bits() {
    let mut rng = Rng(17);
    let (h, i, qt) = (64, 32, QuantType::Q4_0);
    let gate_up = random_matrix(qt, E * 2 * i, h / 32, &mut rng);
    let down = random_matrix(qt, E * h, i / 32, &mut rng);
    let (gu_rb, dn_rb) = (h / 32 * 18, i / 32 * 18);
    let gate_up_x8 = quant::interleave::interleave_q4_0(&gate_up, gu_rb).unwrap();
    let down_x8 = quant::interleave::interleave_q4_0(&down, dn_rb).unwrap();
    let plain = ExpertWeights::Quant {
        gate_up: QuantMatrix::new(qt, &gate_up, gu_rb).unwrap(),
        down: QuantMatrix::new(qt, &down, dn_rb).unwrap(),
    };
    let x8 = ExpertWeights::Quant {
        gate_up: QuantMatrix::new_interleaved(qt, &gate_up_x8, gu_rb).unwrap(),
        down: QuantMatrix::new_interleaved(qt, &down_x8, dn_rb).unwrap(),
    };
    let s = MoeShape {
        hidden: h,
        inter: i,
        ..shape(E, 0)
    };
    let (_, ids, w) = routing(9, &mut rng);
    let x: Vec<f32> = (0..9 * h).map(|_| rng.f32()).collect();
    assert_eq!(
        bits(&run(&x, &ids, &w, x8, s, 2)),
        bits(&run(&x, &ids, &w, plain, s, 2))
    );
}
