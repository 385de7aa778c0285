//! Randomized test of RadixCache + allocator + request rows against a naive reference that
//! stores every cached prefix sequence in a map. `check_integrity` and exact size/slot
//! accounting are verified after every operation.

use std::collections::{HashMap, HashSet};

use pyserve_core::{prepare_extend, RadixCache, ReqToTokenPool, TokenToKVPoolAllocator};

const NUM_SLOTS: usize = 48;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

struct Req {
    row: usize,
    tokens: Vec<i32>,
    prefix_len: usize,
    last_node: usize,
}

struct World {
    cache: RadixCache,
    pool: ReqToTokenPool,
    alloc: TokenToKVPoolAllocator,
    /// Reference: every cached token sequence (a prefix path) -> KV slot of its last token.
    reference: HashMap<Vec<i32>, i64>,
    active: Vec<Req>,
}

impl World {
    fn ref_match(&self, key: &[i32]) -> Vec<i64> {
        (1..=key.len())
            .map_while(|i| self.reference.get(&key[..i]).copied())
            .collect()
    }

    fn ref_insert(&mut self, key: &[i32], slots: &[i64]) -> usize {
        let cached = self.ref_match(key).len();
        for i in cached..key.len() {
            self.reference.insert(key[..i + 1].to_vec(), slots[i]);
        }
        cached
    }

    /// Drops reference entries the tree no longer holds (after an eviction).
    fn sync_after_evict(&mut self) -> usize {
        let keys: Vec<Vec<i32>> = self.reference.keys().cloned().collect();
        let mut removed = 0;
        for k in keys {
            let got = self.cache.match_prefix(&k).indices;
            assert_eq!(got, self.ref_match(&k)[..got.len()].to_vec());
            if got.len() < k.len() {
                self.reference.remove(&k);
                removed += 1;
            }
        }
        removed
    }

    fn check(&self) {
        self.cache.check_integrity().unwrap();
        let protected: HashSet<&[i32]> = self
            .active
            .iter()
            .flat_map(|r| (1..=r.prefix_len).map(move |i| &r.tokens[..i]))
            .collect();
        assert_eq!(self.cache.total_size(), self.reference.len());
        assert_eq!(self.cache.protected_size(), protected.len());
        let own: usize = self
            .active
            .iter()
            .map(|r| r.tokens.len() - r.prefix_len)
            .sum();
        assert_eq!(
            self.alloc.available_size(),
            NUM_SLOTS - self.reference.len() - own
        );
    }

    fn evict(&mut self, num_tokens: usize) {
        let evictable = self.cache.evictable_size();
        let freed = self.cache.evict(num_tokens, &mut self.alloc).unwrap();
        assert!(freed >= num_tokens.min(evictable));
        assert_eq!(self.sync_after_evict(), freed);
    }

    fn admit(&mut self, tokens: Vec<i32>) {
        let m = self.cache.match_prefix(&tokens);
        assert_eq!(m.indices, self.ref_match(&tokens));
        self.cache.inc_lock_ref(m.last_node).unwrap();
        let p = m.indices.len();
        let need = tokens.len() - p;
        if self.alloc.available_size() < need {
            self.evict(need - self.alloc.available_size());
        }
        let Some(row) = self.pool.alloc() else {
            self.cache.dec_lock_ref(m.last_node).unwrap();
            return;
        };
        self.pool.write(row, 0, &m.indices).unwrap();
        let out = prepare_extend(&mut self.pool, &mut self.alloc, &[row], &[p], &[need]).unwrap();
        if out.is_none() {
            self.cache.dec_lock_ref(m.last_node).unwrap();
            self.pool.free(row).unwrap();
            return;
        }
        self.active.push(Req {
            row,
            tokens,
            prefix_len: p,
            last_node: m.last_node,
        });
    }

    fn finish(&mut self, i: usize, keep_running: bool) {
        let r = self.active.swap_remove(i);
        let slots = self.pool.read(r.row, 0, r.tokens.len()).unwrap().to_vec();
        let (c, p, a) = (&mut self.cache, &mut self.pool, &mut self.alloc);
        if keep_running {
            let (np, nn) = c
                .cache_unfinished_req(p, a, r.row, &r.tokens, r.prefix_len, r.last_node)
                .unwrap();
            assert_eq!(np, r.tokens.len());
            self.ref_insert(&r.tokens, &slots);
            let row = self.pool.read(r.row, 0, np).unwrap().to_vec();
            assert_eq!(row, self.ref_match(&r.tokens));
            self.active.push(Req {
                prefix_len: np,
                last_node: nn,
                ..r
            });
        } else {
            c.cache_finished_req(p, a, r.row, &r.tokens, r.prefix_len, r.last_node)
                .unwrap();
            self.ref_insert(&r.tokens, &slots);
        }
    }
}

#[test]
fn random_ops_match_reference() {
    for seed in 0..20u64 {
        let mut rng = Lcg(seed);
        let mut w = World {
            cache: RadixCache::new(1, false).unwrap(),
            pool: ReqToTokenPool::new(6, 24),
            alloc: TokenToKVPoolAllocator::new(NUM_SLOTS),
            reference: HashMap::new(),
            active: Vec::new(),
        };
        for _ in 0..400 {
            match rng.next(10) {
                0..=3 => {
                    let len = 1 + rng.next(8);
                    let tokens = (0..len).map(|_| rng.next(3) as i32).collect();
                    w.admit(tokens);
                }
                4 | 5 if !w.active.is_empty() => {
                    let i = rng.next(w.active.len());
                    w.finish(i, false);
                }
                6 if !w.active.is_empty() => {
                    let i = rng.next(w.active.len());
                    w.finish(i, true);
                }
                7 if !w.active.is_empty() => {
                    // grow a running request by a few tokens (next prefill chunk)
                    let i = rng.next(w.active.len());
                    let r = &mut w.active[i];
                    let extra = (1 + rng.next(3)).min(24 - r.tokens.len());
                    let start = r.tokens.len();
                    let ok =
                        prepare_extend(&mut w.pool, &mut w.alloc, &[r.row], &[start], &[extra])
                            .unwrap()
                            .is_some();
                    if ok {
                        r.tokens.extend((0..extra).map(|_| rng.next(3) as i32));
                    }
                }
                8 if !w.active.is_empty() => {
                    let r = w.active.swap_remove(rng.next(w.active.len()));
                    let (c, p, a) = (&mut w.cache, &mut w.pool, &mut w.alloc);
                    c.release_req(p, a, r.row, r.tokens.len(), r.prefix_len, r.last_node)
                        .unwrap();
                }
                _ => {
                    let n = rng.next(12);
                    w.evict(n);
                }
            }
            w.check();
        }
        let alloc = &mut w.alloc;
        for r in w.active.drain(..) {
            w.cache
                .release_req(
                    &mut w.pool,
                    alloc,
                    r.row,
                    r.tokens.len(),
                    r.prefix_len,
                    r.last_node,
                )
                .unwrap();
        }
        w.cache.reset(alloc).unwrap();
        assert_eq!(alloc.available_size(), NUM_SLOTS);
        w.cache.check_integrity().unwrap();
    }
}
