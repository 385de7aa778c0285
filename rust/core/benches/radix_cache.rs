//! Criterion benchmarks of the core on a ~10^6-token tree: match_prefix of an 8k-token
//! prompt, finishing a 2k-token request (insert), evicting 8192 tokens, and building a
//! 256-request decode step. `cargo bench -p pyserve-core`.

use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion};
use pyserve_core::KVCache;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }

    fn tokens(&mut self, n: usize) -> Vec<i32> {
        (0..n).map(|_| self.next(32000) as i32).collect()
    }
}

fn serve(c: &mut KVCache, tokens: &[i32]) {
    let a = c.add_req(&tokens[..tokens.len() - 1]).unwrap().unwrap();
    c.prepare_extend(&[a.req_id], &[tokens.len() - a.prefix_len])
        .unwrap()
        .unwrap();
    c.cache_finished_req(a.req_id, tokens).unwrap();
}

/// A cache holding ~`size` tokens: 16 system prompts shared by multi-turn chats, plus
/// random prompts; returns it with an 8k-token cached prompt.
fn build(size: usize) -> (KVCache, Vec<i32>, Lcg) {
    let mut rng = Lcg(7);
    let mut c = KVCache::new(1_700_000, 1, 300, 16384, false).unwrap();
    let long = rng.tokens(8192);
    serve(&mut c, &long);
    let systems: Vec<Vec<i32>> = (0..16)
        .map(|_| {
            let n = 300 + rng.next(1200) as usize;
            rng.tokens(n)
        })
        .collect();
    while c.tree.evictable_size() < size {
        if rng.next(10) < 7 {
            let mut h = systems[rng.next(16) as usize].clone();
            for _ in 0..1 + rng.next(12) {
                let (u, a) = (50 + rng.next(250) as usize, 100 + rng.next(300) as usize);
                h.extend(rng.tokens(u + a));
                if h.len() > 8000 {
                    break;
                }
                serve(&mut c, &h);
            }
        } else {
            let n = 200 + rng.next(1800) as usize;
            serve(&mut c, &rng.tokens(n));
        }
    }
    (c, long, rng)
}

fn benches(cr: &mut Criterion) {
    let (mut c, long, mut rng) = build(1_000_000);
    cr.bench_function("match_prefix 8k on 1e6 tree", |b| {
        b.iter(|| black_box(c.match_prefix(&long)))
    });
    cr.bench_function("finish 2k-token request (insert)", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let mut t = long[..1000].to_vec();
                t.extend(rng.tokens(1000));
                let a = c.add_req(&t[..t.len() - 1]).unwrap().unwrap();
                c.prepare_extend(&[a.req_id], &[t.len() - a.prefix_len])
                    .unwrap()
                    .unwrap();
                let start = Instant::now();
                c.cache_finished_req(a.req_id, &t).unwrap();
                total += start.elapsed();
            }
            total
        })
    });
    cr.bench_function("evict 8192 tokens", |b| {
        b.iter_batched(
            || c.clone(),
            |mut c| {
                black_box(c.evict(8192).unwrap());
                c // dropped outside the timing
            },
            BatchSize::LargeInput,
        )
    });
    let mut admit_256 = |c: &mut KVCache| -> Vec<u64> {
        (0..256)
            .map(|_| {
                let n = 100 + rng.next(1900) as usize;
                let a = c.add_req(&rng.tokens(n)).unwrap().unwrap();
                c.prepare_extend(&[a.req_id], &[n - a.prefix_len])
                    .unwrap()
                    .unwrap();
                a.req_id
            })
            .collect()
    };
    let mut ids = admit_256(&mut c);
    cr.bench_function("decode step 256 requests", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                if i % 64 == 63 {
                    // keep sequence lengths realistic: replace the batch now and then
                    ids.iter().for_each(|&id| assert!(c.free_req(id).unwrap()));
                    ids = admit_256(&mut c);
                }
                let start = Instant::now();
                black_box(c.prepare_decode(&ids).unwrap().unwrap());
                total += start.elapsed();
            }
            total
        })
    });
}

criterion_group! {
    name = radix;
    config = Criterion::default().sample_size(20).warm_up_time(std::time::Duration::from_millis(500))
        .measurement_time(std::time::Duration::from_secs(2));
    targets = benches
}
criterion_main!(radix);
