//! What the cache-aware scheduling policies read from the tree, without changing it: the
//! cached prefix length of each waiting request (`lpm`) and the depth-first order of the
//! waiting requests by the tree's branches (`dfs-weight`).
//!
//! `dfs-weight` is SGLang's policy of that name, written here from its description: each
//! waiting request sits at the deepest node its key fully matches; a node's weight is the
//! number of waiting requests in its subtree; a depth-first walk from the root emits each
//! node's requests (in queue order) before visiting its children, heaviest child first, so
//! requests that share a cached branch are admitted together. Ties between children go to
//! the older node (SGLang visits its children dict in insertion order).

use super::{common_prefix_len, RadixCache, ROOT};

impl RadixCache {
    /// The deepest node whose whole key path is a prefix of `key` (ROOT if none), and the
    /// page-aligned cached prefix length of `key` (as `match_len`). Changes nothing.
    pub fn match_node(&self, key: &[i32]) -> (usize, usize) {
        let ps = self.page_size;
        let (mut node, mut pos) = (ROOT, 0);
        while pos + ps <= key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[pos..pos + ps]) else {
                break;
            };
            let k = &self.nodes[child].key;
            let plen = common_prefix_len(k, &key[pos..], ps);
            pos += plen;
            if plen < k.len() {
                break;
            }
            node = child;
        }
        (node, pos)
    }

    /// (cached page-aligned prefix length of `key`, how many of those tokens no request has
    /// locked): what admitting a request with this key would lock and so take out of the
    /// evictable pool. Changes nothing.
    pub fn match_unlocked(&self, key: &[i32]) -> (usize, usize) {
        let ps = self.page_size;
        let (mut node, mut pos, mut unlocked) = (ROOT, 0, 0);
        while pos + ps <= key.len() {
            let Some(&child) = self.nodes[node].children.get(&key[pos..pos + ps]) else {
                break;
            };
            let c = &self.nodes[child];
            let plen = common_prefix_len(&c.key, &key[pos..], ps);
            if c.lock_ref == 0 {
                unlocked += plen;
            }
            pos += plen;
            if plen < c.key.len() {
                break;
            }
            node = child;
        }
        (pos, unlocked)
    }

    /// Length of the longest cached page-aligned prefix of `key`, without changing anything
    /// (no split, no access-time update). Disabled: 0.
    pub fn match_len(&self, key: &[i32]) -> usize {
        self.match_node(key).1
    }

    /// The order (indices into `keys`) in which `dfs-weight` admits requests with these keys
    /// (see the module docs). O(sum of key lengths + nodes on the matched paths).
    pub fn dfs_weight_order(&self, keys: &[&[i32]]) -> Vec<usize> {
        use std::collections::HashMap;
        let mut reqs_at: HashMap<usize, Vec<usize>> = HashMap::new();
        let mut weight: HashMap<usize, usize> = HashMap::new();
        for (i, key) in keys.iter().enumerate() {
            let (node, _) = self.match_node(key);
            reqs_at.entry(node).or_default().push(i);
            let mut n = node;
            loop {
                *weight.entry(n).or_insert(0) += 1;
                if n == ROOT {
                    break;
                }
                n = self.nodes[n].parent;
            }
        }
        let mut order = Vec::with_capacity(keys.len());
        let mut stack = vec![ROOT];
        while let Some(node) = stack.pop() {
            if let Some(reqs) = reqs_at.get(&node) {
                order.extend_from_slice(reqs);
            }
            let mut children: Vec<(usize, usize)> = self.nodes[node]
                .children
                .values()
                .filter_map(|&c| weight.get(&c).map(|&w| (w, c)))
                .collect();
            // heaviest first, then the older node; pushed in reverse so the first pops first
            children.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
            stack.extend(children.iter().rev().map(|&(_, c)| c));
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use crate::allocator::TokenToKVPoolAllocator;
    use crate::radix_cache::RadixCache;

    fn tree_with(keys: &[&[i32]]) -> RadixCache {
        let mut alloc = TokenToKVPoolAllocator::new(1000, 1).unwrap();
        let mut tree = RadixCache::new(1, false).unwrap();
        for key in keys {
            let slots = alloc.alloc(key.len()).unwrap();
            tree.insert(key, &slots).unwrap();
        }
        tree
    }

    #[test]
    fn match_node_stops_at_the_deepest_fully_matched_node() {
        let tree = tree_with(&[&[1, 2, 3], &[1, 2, 4, 5]]); // root - [1,2] - {[3], [4,5]}
        let (n, len) = tree.match_node(&[1, 2, 4, 5, 6]);
        assert_eq!(len, 4);
        assert_eq!(tree.nodes[n].key, vec![4, 5]);
        let (n, len) = tree.match_node(&[1, 2, 4, 9]); // into [4,5] partly: its parent [1,2]
        assert_eq!(len, 3);
        assert_eq!(tree.nodes[n].key, vec![1, 2]);
        assert_eq!(tree.match_node(&[7]), (super::ROOT, 0));
    }

    #[test]
    fn match_unlocked_counts_what_a_lock_would_protect() {
        let mut tree = tree_with(&[&[1, 2, 3], &[1, 2, 4, 5]]); // root - [1,2] - {[3], [4,5]}
        assert_eq!(tree.match_unlocked(&[1, 2, 4, 5, 6]), (4, 4));
        let m = tree.match_prefix(&[1, 2, 3]); // lock [1,2] - [3]
        tree.inc_lock_ref(m.last_node).unwrap();
        assert_eq!(tree.match_unlocked(&[1, 2, 4, 5, 6]), (4, 2)); // [1,2] is locked already
        assert_eq!(tree.match_unlocked(&[1, 2, 4, 9]), (3, 1)); // one token into [4,5]
        assert_eq!(tree.match_unlocked(&[1, 2, 3]), (3, 0));
        assert_eq!(tree.match_unlocked(&[8]), (0, 0));
    }

    #[test]
    fn dfs_weight_groups_requests_by_heaviest_branch() {
        // branches: A = [1,2,3] and B = [5,6]
        let tree = tree_with(&[&[1, 2, 3], &[5, 6]]);
        let keys: Vec<&[i32]> = vec![
            &[5, 6, 1],    // 0: B
            &[9],          // 1: root
            &[1, 2, 3, 7], // 2: A
            &[1, 2, 3, 8], // 3: A
            &[5, 6, 2],    // 4: B
            &[1, 2, 3, 9], // 5: A
        ];
        // root's own request first, then A (3 requests) before B (2), each in queue order
        assert_eq!(tree.dfs_weight_order(&keys), vec![1, 2, 3, 5, 0, 4]);
        // equal weights: the older node (A, inserted first) first
        let keys: Vec<&[i32]> = vec![&[5, 6, 0], &[1, 2, 3, 0]];
        assert_eq!(tree.dfs_weight_order(&keys), vec![1, 0]);
    }
}
