//! Property-based test: random sequences of add / lock / unlock / match / extend / decode /
//! finish (insert) / unfinished / abort / repeated finish / evict on a `KVCache`, compared
//! after every operation with a naive reference model and with `check_integrity()`, for page
//! sizes 1, 3, 16 and 64 (64 cases x 100 operations each: 25,600 operations per run).
//!
//! The reference stores every cached page-aligned prefix (token ids -> first slot of its last
//! page, access time). It predicts matches exactly, the tree/protected/free sizes exactly,
//! and for evictions checks the LRU order: nothing evicted was used more recently than an
//! unlocked leaf that stays. "Lock" admits a request on a cached prefix without computing
//! anything, "unlock" aborts it.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use pyserve_core::KVCache;

const NUM_PAGES: usize = 12;
const ROWS: usize = 4;

#[derive(Debug, Clone)]
enum Op {
    Add(Vec<u8>, u8),
    Lock(u8),
    Unlock(u8),
    Match(Vec<u8>, u8),
    Extend(u8, u8),
    Decode(u8),
    Finish(u8),
    Unfinished(u8),
    Abort(u8),
    Again(u8),
    Evict(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let blocks = || prop::collection::vec(0u8..6, 0..4);
    prop_oneof![
        3 => (blocks(), any::<u8>()).prop_map(|(b, t)| Op::Add(b, t)),
        1 => any::<u8>().prop_map(Op::Lock),
        1 => any::<u8>().prop_map(Op::Unlock),
        1 => (blocks(), any::<u8>()).prop_map(|(b, t)| Op::Match(b, t)),
        3 => (any::<u8>(), any::<u8>()).prop_map(|(i, n)| Op::Extend(i, n)),
        3 => any::<u8>().prop_map(Op::Decode),
        2 => any::<u8>().prop_map(Op::Finish),
        1 => any::<u8>().prop_map(Op::Unfinished),
        1 => any::<u8>().prop_map(Op::Abort),
        1 => any::<u8>().prop_map(Op::Again),
        1 => any::<u8>().prop_map(Op::Evict),
    ]
}

struct Req {
    id: u64,
    tokens: Vec<i32>,
    prefix_len: usize,
}

struct Model {
    ps: usize,
    c: KVCache,
    /// Cached page-aligned prefix -> (first slot of its last page, access time).
    cached: HashMap<Vec<i32>, (i64, u64)>,
    reqs: Vec<Req>,
    released: Vec<u64>,
    now: u64,
}

impl Model {
    fn new(ps: usize) -> Self {
        let c = KVCache::new(NUM_PAGES * ps, ps, ROWS, 8 * ps, false).unwrap();
        Self {
            ps,
            c,
            cached: HashMap::new(),
            reqs: Vec::new(),
            released: Vec::new(),
            now: 0,
        }
    }

    /// A key of whole "blocks" (block b < 3: a page of token b; b >= 3: a page of token b - 3
    /// ending in token 9) plus a tail of `tail % (ps + 2)` tokens.
    fn key(&self, blocks: &[u8], tail: u8) -> Vec<i32> {
        let mut k = Vec::new();
        for &b in blocks {
            let mut page = vec![(b % 3) as i32; self.ps];
            if b >= 3 {
                page[self.ps - 1] = 9;
            }
            k.extend(page);
        }
        k.extend((0..tail as usize % (self.ps + 2)).map(|i| (i % 2) as i32));
        k
    }

    fn ref_match(&self, key: &[i32]) -> Vec<i64> {
        let ps = self.ps as i64;
        (1..=key.len() / self.ps)
            .map_while(|p| self.cached.get(&key[..p * self.ps]).map(|&(s, _)| s))
            .flat_map(|s| s..s + ps)
            .collect()
    }

    /// Stamps the first `len` tokens' pages of `key` with a new access time.
    fn touch(&mut self, key: &[i32], len: usize) {
        self.now += 1;
        for p in 1..=len / self.ps {
            self.cached.get_mut(&key[..p * self.ps]).expect("cached").1 = self.now;
        }
    }

    fn ref_insert(&mut self, key: &[i32], slots: &[i64]) {
        self.now += 1;
        for p in 1..=key.len() / self.ps {
            let e = self
                .cached
                .entry(key[..p * self.ps].to_vec())
                .or_insert((slots[(p - 1) * self.ps], 0));
            e.1 = self.now;
        }
    }

    fn locked(&self) -> HashSet<&[i32]> {
        self.reqs
            .iter()
            .flat_map(|r| (1..=r.prefix_len / self.ps).map(move |p| &r.tokens[..p * self.ps]))
            .collect()
    }

    /// Drops reference entries the tree no longer holds; checks the LRU order of what went.
    fn sync_after_evict(&mut self) -> usize {
        let gone: Vec<Vec<i32>> = self
            .cached
            .keys()
            .filter(|k| self.c.tree.match_len(k) < k.len())
            .cloned()
            .collect();
        let max_gone = gone.iter().map(|k| self.cached[k].1).max();
        for k in &gone {
            self.cached.remove(k);
        }
        let locked = self.locked();
        let has_child = |k: &[i32]| {
            self.cached
                .keys()
                .any(|o| o.len() == k.len() + self.ps && o.starts_with(k))
        };
        let min_leaf = self
            .cached
            .iter()
            .filter(|(k, _)| !locked.contains(k.as_slice()) && !has_child(k))
            .map(|(_, v)| v.1)
            .min();
        if let (Some(g), Some(l)) = (max_gone, min_leaf) {
            assert!(
                g <= l,
                "evicted a page used at {g} while a leaf used at {l} stays"
            );
        }
        gone.len() * self.ps
    }

    /// The KV slot of each stored token of live request `id` (its row), as `i64`.
    fn slots_of(&self, id: u64) -> Vec<i64> {
        self.c
            .req_slots(id)
            .unwrap()
            .iter()
            .map(|&s| s.into())
            .collect()
    }

    fn own_pages(&self, r: &Req) -> usize {
        r.tokens.len().div_ceil(self.ps) - r.prefix_len / self.ps
    }

    fn check(&self) {
        self.c.check_integrity().unwrap();
        let ps = self.ps;
        assert_eq!(self.c.tree.total_size(), self.cached.len() * ps);
        assert_eq!(self.c.tree.protected_size(), self.locked().len() * ps);
        let own: usize = self.reqs.iter().map(|r| self.own_pages(r)).sum();
        assert_eq!(
            self.c.alloc.available_pages(),
            NUM_PAGES - self.cached.len() - own
        );
        for r in &self.reqs {
            let st = self.c.req(r.id).unwrap();
            assert_eq!((st.prefix_len, st.kv_len), (r.prefix_len, r.tokens.len()));
            let slots = self.slots_of(r.id);
            assert_eq!(
                slots[..r.prefix_len],
                self.ref_match(&r.tokens)[..r.prefix_len]
            );
        }
    }

    fn pick(&self, i: u8) -> Option<usize> {
        (!self.reqs.is_empty()).then(|| i as usize % self.reqs.len())
    }

    fn add(&mut self, key: Vec<i32>, compute: bool) {
        let want = self.ref_match(&key);
        let Some(a) = self.c.add_req(&key).unwrap() else {
            assert_eq!(self.reqs.len(), ROWS);
            return;
        };
        assert_eq!(a.prefix_len, want.len());
        self.touch(&key, want.len());
        let mut tokens = key;
        tokens.truncate(a.prefix_len);
        self.reqs.push(Req {
            id: a.req_id,
            tokens,
            prefix_len: a.prefix_len,
        });
        if compute {
            let i = self.reqs.len() - 1;
            self.extend(i, 1 + self.ps / 2);
        }
    }

    fn extend(&mut self, i: usize, n: usize) {
        let r = &self.reqs[i];
        let (kv, id) = (r.tokens.len(), r.id);
        let n = n.min(8 * self.ps - kv);
        let need = (kv + n).div_ceil(self.ps) - kv.div_ceil(self.ps);
        let short = need.saturating_sub(self.c.alloc.available_pages());
        let decode = n == 1 && self.now.is_multiple_of(2);
        let out = if decode {
            self.c.prepare_decode(&[id]).unwrap()
        } else {
            self.c.prepare_extend(&[id], &[n]).unwrap()
        };
        let freed = self.sync_after_evict();
        if short == 0 {
            assert_eq!(freed, 0, "evicted with enough free pages");
        }
        let Some(a) = out else {
            assert!(self.c.alloc.available_pages() < need);
            assert_eq!(self.c.tree.evictable_size(), 0);
            return;
        };
        assert_eq!(
            a.positions,
            (kv as i32..(kv + n) as i32).collect::<Vec<_>>()
        );
        if decode {
            // the new slot is the row's last; the row is not copied out
            assert!(a.kv_indices.is_empty());
            assert_eq!(
                a.out_cache_loc[0],
                *self.c.req_slots(id).unwrap().last().unwrap()
            );
        } else {
            assert_eq!(a.kv_indices, self.c.req_slots(id).unwrap());
        }
        let r = &mut self.reqs[i];
        r.tokens.extend((0..n).map(|j| ((kv + j) % 2) as i32));
    }

    fn apply(&mut self, op: Op) {
        match op {
            Op::Add(b, t) => self.add(self.key(&b, t), true),
            Op::Lock(i) => {
                let keys: Vec<&Vec<i32>> = self.cached.keys().collect();
                if !keys.is_empty() {
                    let k = keys[i as usize % keys.len()].clone();
                    self.add(k, false);
                }
            }
            Op::Unlock(i) | Op::Abort(i) => {
                if let Some(i) = self.pick(i) {
                    let r = self.reqs.swap_remove(i);
                    assert!(self.c.free_req(r.id).unwrap());
                    self.released.push(r.id);
                }
            }
            Op::Match(b, t) => {
                let key = self.key(&b, t);
                let want = self.ref_match(&key);
                assert_eq!(self.c.match_prefix(&key).indices, want);
                self.touch(&key, want.len());
            }
            Op::Extend(i, n) => {
                if let Some(i) = self.pick(i) {
                    self.extend(i, 1 + n as usize % (2 * self.ps + 1));
                }
            }
            Op::Decode(i) => {
                if let Some(i) = self.pick(i) {
                    self.extend(i, 1);
                }
            }
            Op::Finish(i) => {
                if let Some(i) = self.pick(i) {
                    let r = self.reqs.swap_remove(i);
                    let slots = self.slots_of(r.id);
                    assert!(self.c.cache_finished_req(r.id, &r.tokens).unwrap());
                    self.ref_insert(&r.tokens, &slots);
                    self.released.push(r.id);
                }
            }
            Op::Unfinished(i) => {
                if let Some(i) = self.pick(i) {
                    let (id, tokens) = (self.reqs[i].id, self.reqs[i].tokens.clone());
                    let slots = self.slots_of(id);
                    let p = self.c.cache_unfinished_req(id, &tokens).unwrap();
                    assert_eq!(p, tokens.len() / self.ps * self.ps);
                    self.ref_insert(&tokens, &slots);
                    self.touch(&tokens, p);
                    self.reqs[i].prefix_len = p;
                }
            }
            Op::Again(i) => {
                if !self.released.is_empty() {
                    let id = self.released[i as usize % self.released.len()];
                    assert!(!self.c.free_req(id).unwrap());
                    assert!(!self.c.cache_finished_req(id, &[]).unwrap());
                }
            }
            Op::Evict(n) => {
                let n = n as usize % (4 * self.ps);
                let before = self.c.tree.evictable_size();
                let freed = self.c.evict(n).unwrap();
                assert!(freed >= n.min(before));
                assert_eq!(self.sync_after_evict(), freed);
            }
        }
        self.check();
    }
}

fn run(ps: usize, ops: Vec<Op>) {
    let mut m = Model::new(ps);
    for op in ops {
        m.apply(op);
    }
    for r in std::mem::take(&mut m.reqs) {
        assert!(m.c.free_req(r.id).unwrap());
    }
    if std::env::var_os("MODEL_STATS").is_some() {
        eprintln!(
            "ps {ps}: {} cached pages, {} released, clock {}",
            m.cached.len(),
            m.released.len(),
            m.now
        );
    }
    m.c.reset().unwrap();
    m.c.check_integrity().unwrap();
    assert_eq!(m.c.alloc.available_pages(), NUM_PAGES);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn model_page_size_1(ops in prop::collection::vec(op(), 100)) { run(1, ops) }

    #[test]
    fn model_page_size_16(ops in prop::collection::vec(op(), 100)) { run(16, ops) }

    #[test]
    fn model_page_size_64(ops in prop::collection::vec(op(), 100)) { run(64, ops) }

    #[test]
    fn model_page_size_3(ops in prop::collection::vec(op(), 100)) { run(3, ops) }
}
