//! Differential test of eviction order: random sequences of insert / match (and lock) /
//! unlock / evict run through `RadixCache` and through a reference tree that follows SGLang's
//! `RadixCache` rules literally (python/sglang/srt/mem_cache/radix_cache.py, 0.5.x, read
//! for its rules, not copied): an operation stamps the start node (root) and every node it
//! walks into with its time, even the node a match ends inside of; a node it creates (the
//! upper half of a split, a new leaf) gets a later time of its own, in creation order;
//! eviction pops the unlocked leaf with the oldest time, frees it whole, and offers its parent
//! once that is an unlocked leaf. Every match length, insert result, evicted-token count and
//! size must be equal, and after every eviction the same keys must still be cached, for page
//! sizes 1, 2 and 4.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use proptest::prelude::*;
use pyserve_core::{RadixCache, TokenToKVPoolAllocator};

struct RefNode {
    key: Vec<i32>,
    parent: usize,
    children: HashMap<Vec<i32>, usize>,
    lock_ref: usize,
    time: u64,
    live: bool,
}

/// The reference: SGLang's algorithm on a plain arena of nodes (0 is the root).
struct RefTree {
    ps: usize,
    nodes: Vec<RefNode>,
    clock: u64,
    evictable: usize,
    protected: usize,
}

impl RefTree {
    fn new(ps: usize) -> Self {
        let root = RefNode {
            key: vec![],
            parent: 0,
            children: HashMap::new(),
            lock_ref: 0,
            time: 0,
            live: true,
        };
        Self {
            ps,
            nodes: vec![root],
            clock: 0,
            evictable: 0,
            protected: 0,
        }
    }

    fn now(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    fn common(&self, a: &[i32], b: &[i32]) -> usize {
        let mut i = 0;
        while i + self.ps <= a.len().min(b.len()) && a[i..i + self.ps] == b[i..i + self.ps] {
            i += self.ps;
        }
        i
    }

    fn split(&mut self, child: usize, at: usize) -> usize {
        let ps = self.ps;
        let parent = self.nodes[child].parent;
        let upper_key: Vec<i32> = self.nodes[child].key[..at].to_vec();
        let lower_key: Vec<i32> = self.nodes[child].key[at..].to_vec();
        let time = self.now(); // a created node: newer than everything walked
        let id = self.nodes.len();
        let mut children = HashMap::new();
        children.insert(lower_key[..ps].to_vec(), child);
        self.nodes.push(RefNode {
            key: upper_key.clone(),
            parent,
            children,
            lock_ref: self.nodes[child].lock_ref,
            time,
            live: true,
        });
        self.nodes[child].key = lower_key;
        self.nodes[child].parent = id;
        self.nodes[parent]
            .children
            .insert(upper_key[..ps].to_vec(), id);
        id
    }

    /// Walks `key` (whole pages), as SGLang's match / insert helpers do; returns (matched
    /// tokens, last node).
    fn walk(&mut self, key: &[i32], insert: bool) -> (usize, usize) {
        let ps = self.ps;
        let now = self.now();
        self.nodes[0].time = now;
        let (mut node, mut pos) = (0, 0);
        while pos + ps <= key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[pos..pos + ps]) else {
                break;
            };
            self.nodes[child].time = now;
            let plen = self.common(&self.nodes[child].key.clone(), &key[pos..]);
            pos += plen;
            if plen < self.nodes[child].key.len() {
                node = self.split(child, plen);
                if !insert {
                    break;
                }
            } else {
                node = child;
            }
        }
        (pos, node)
    }

    fn match_prefix(&mut self, key: &[i32]) -> (usize, usize) {
        let end = key.len() / self.ps * self.ps;
        self.walk(&key[..end], false)
    }

    fn insert(&mut self, key: &[i32]) -> usize {
        let end = key.len() / self.ps * self.ps;
        let key = &key[..end];
        let (pos, node) = self.walk(key, true);
        if pos < key.len() {
            let time = self.now();
            let id = self.nodes.len();
            self.nodes.push(RefNode {
                key: key[pos..].to_vec(),
                parent: node,
                children: HashMap::new(),
                lock_ref: 0,
                time,
                live: true,
            });
            self.nodes[node]
                .children
                .insert(key[pos..pos + self.ps].to_vec(), id);
            self.evictable += key.len() - pos;
        }
        pos
    }

    fn lock(&mut self, mut node: usize, delta: isize) {
        while node != 0 {
            let n = &mut self.nodes[node];
            if delta > 0 && n.lock_ref == 0 {
                self.evictable -= n.key.len();
                self.protected += n.key.len();
            }
            if delta < 0 && n.lock_ref == 1 {
                self.evictable += n.key.len();
                self.protected -= n.key.len();
            }
            n.lock_ref = (n.lock_ref as isize + delta) as usize;
            node = n.parent;
        }
    }

    fn evictable_leaf(&self, id: usize) -> bool {
        let n = &self.nodes[id];
        id != 0 && n.live && n.lock_ref == 0 && n.children.is_empty()
    }

    fn evict(&mut self, num_tokens: usize) -> usize {
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (1..self.nodes.len())
            .filter(|&i| self.evictable_leaf(i))
            .map(|i| Reverse((self.nodes[i].time, i)))
            .collect();
        let mut freed = 0;
        while freed < num_tokens {
            let Some(Reverse((_, id))) = heap.pop() else {
                break;
            };
            let (parent, first, len) = {
                let n = &self.nodes[id];
                (n.parent, n.key[..self.ps].to_vec(), n.key.len())
            };
            self.nodes[id].live = false;
            self.nodes[parent].children.remove(&first);
            self.evictable -= len;
            freed += len;
            if self.evictable_leaf(parent) {
                heap.push(Reverse((self.nodes[parent].time, parent)));
            }
        }
        freed
    }
}

#[derive(Debug, Clone)]
enum Op {
    Insert(Vec<u8>),
    Match(Vec<u8>, bool),
    Unlock(u8),
    Evict(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let key = || prop::collection::vec(0u8..3, 1..7);
    prop_oneof![
        4 => key().prop_map(Op::Insert),
        3 => (key(), any::<bool>()).prop_map(|(k, l)| Op::Match(k, l)),
        1 => any::<u8>().prop_map(Op::Unlock),
        2 => any::<u8>().prop_map(Op::Evict),
    ]
}

fn run(ps: usize, ops: Vec<Op>) {
    let mut alloc = TokenToKVPoolAllocator::new(4096 * ps, ps).unwrap();
    let mut tree = RadixCache::new(ps, false).unwrap();
    let mut reference = RefTree::new(ps);
    let mut locks: Vec<(usize, usize)> = Vec::new(); // (tree node, reference node)
    let mut seen: Vec<Vec<i32>> = Vec::new();
    // a key: pages of tokens (b, b+1, ...) so different blocks give different pages
    let key_of = |blocks: &[u8]| -> Vec<i32> {
        blocks
            .iter()
            .flat_map(|&b| (0..ps).map(move |j| i32::from(b) * 10 + j as i32))
            .collect()
    };
    for op in ops {
        match op {
            Op::Insert(b) => {
                let key = key_of(&b);
                let slots = alloc.alloc(key.len()).unwrap();
                let got = tree.insert(&key, &slots).unwrap();
                assert_eq!(got, reference.insert(&key), "insert {key:?}");
                alloc.free(&slots[..got]).unwrap(); // the duplicates the tree did not take
                seen.push(key);
            }
            Op::Match(b, lock) => {
                let key = key_of(&b);
                let m = tree.match_prefix(&key);
                let (len, node) = reference.match_prefix(&key);
                assert_eq!(m.indices.len(), len, "match {key:?}");
                if lock && len > 0 {
                    tree.inc_lock_ref(m.last_node).unwrap();
                    reference.lock(node, 1);
                    locks.push((m.last_node, node));
                }
            }
            Op::Unlock(i) => {
                if !locks.is_empty() {
                    let (t, r) = locks.swap_remove(i as usize % locks.len());
                    tree.dec_lock_ref(t).unwrap();
                    reference.lock(r, -1);
                }
            }
            Op::Evict(n) => {
                let n = (n as usize % 6) * ps;
                assert_eq!(
                    tree.evict(n, &mut alloc).unwrap(),
                    reference.evict(n),
                    "evict {n}"
                );
                for key in &seen {
                    // what stays cached is the same (a pure length query changes no time)
                    let want = {
                        let mut node = 0;
                        let mut pos = 0;
                        while pos + ps <= key.len() {
                            match reference.nodes[node].children.get(&key[pos..pos + ps]) {
                                Some(&c) => {
                                    let plen =
                                        reference.common(&reference.nodes[c].key, &key[pos..]);
                                    pos += plen;
                                    if plen < reference.nodes[c].key.len() {
                                        break;
                                    }
                                    node = c;
                                }
                                None => break,
                            }
                        }
                        pos
                    };
                    assert_eq!(tree.match_len(key), want, "after evict, {key:?}");
                }
            }
        }
        assert_eq!(
            (tree.evictable_size(), tree.protected_size()),
            (reference.evictable, reference.protected)
        );
        tree.check_integrity().unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn eviction_order_equals_sglang_page_size_1(ops in prop::collection::vec(op(), 120)) { run(1, ops) }

    #[test]
    fn eviction_order_equals_sglang_page_size_2(ops in prop::collection::vec(op(), 120)) { run(2, ops) }

    #[test]
    fn eviction_order_equals_sglang_page_size_4(ops in prop::collection::vec(op(), 120)) { run(4, ops) }
}

#[test]
fn the_tie_rules_decide_which_leaf_goes() {
    // insert [a b] (leaf L1), then insert [a c]: the walk into L1 stamps it (time t), the
    // split's upper half [a] and the new leaf [c] come after it. L1's lower half [b] is the
    // oldest leaf, so it goes first, then [c].
    for ps in [1, 2] {
        let k = |v: &[i32]| -> Vec<i32> {
            v.iter().flat_map(|&x| std::iter::repeat_n(x, ps)).collect()
        };
        let mut alloc = TokenToKVPoolAllocator::new(64 * ps, ps).unwrap();
        let mut tree = RadixCache::new(ps, false).unwrap();
        for key in [k(&[1, 2]), k(&[1, 3])] {
            let slots = alloc.alloc(key.len()).unwrap();
            let got = tree.insert(&key, &slots).unwrap();
            alloc.free(&slots[..got]).unwrap();
        }
        assert_eq!(tree.evict(1, &mut alloc).unwrap(), ps);
        assert_eq!(
            (tree.match_len(&k(&[1, 2])), tree.match_len(&k(&[1, 3]))),
            (ps, 2 * ps)
        );
        assert_eq!(tree.evict(1, &mut alloc).unwrap(), ps);
        assert_eq!(tree.match_len(&k(&[1, 3])), ps);
    }
}
