//! The global consistency check of a `KVCache`: tree, allocator, rows and requests together.

use std::collections::HashMap;

use super::KVCache;
use crate::error::{CoreError, CoreResult};
use crate::radix_cache::ROOT;

fn broken(msg: String) -> CoreError {
    CoreError::Invariant(msg)
}

/// Who holds a KV page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    Nobody,
    Free,
    Tree,
    Req(u64),
}

impl KVCache {
    /// Verifies every invariant of the KV bookkeeping; mutates nothing. O(pages + tokens).
    ///
    /// Checks [`crate::RadixCache::check_integrity`], and: every page `1..=num_pages` has
    /// exactly one owner among the free list, a tree node and a request's own columns
    /// `[prefix_len, kv_len)` (no page both free and used, none owned twice, none leaked);
    /// a request's own slots sit at `page * page_size + position % page_size`; each live
    /// request has its own allocated row, a page-aligned `prefix_len <= kv_len`, and row
    /// `[0, prefix_len)` equal to the slots on the tree path ending at `last_node`; each
    /// node's `lock_ref` equals the number of requests whose path passes through it; rows in
    /// use equal live requests; ids are below the next id.
    ///
    /// Errors: [`CoreError::Invariant`] naming the first violation found.
    pub fn check_integrity(&self) -> CoreResult<()> {
        self.tree.check_integrity()?;
        let ps = self.page_size();
        let mut owner = vec![Owner::Nobody; self.alloc.num_pages() + 1];
        fn claim(owner: &mut [Owner], page: u32, who: Owner) -> CoreResult<()> {
            match owner.get_mut(page as usize) {
                Some(o) if page != 0 && *o == Owner::Nobody => {
                    *o = who;
                    Ok(())
                }
                Some(o) => Err(broken(format!(
                    "page {page} claimed by {who:?}, held by {o:?}"
                ))),
                None => Err(broken(format!("page {page} out of range ({who:?})"))),
            }
        }
        for p in self.alloc.free_page_list() {
            if !self.alloc.is_page_free(p) {
                return Err(broken(format!("page {p} on the free list but marked used")));
            }
            claim(&mut owner, p, Owner::Free)?;
        }
        for n in self.tree.nodes.iter().filter(|n| n.live) {
            let slots: Vec<u32> = n.value.iter().collect();
            for chunk in slots.chunks(ps) {
                claim(&mut owner, self.alloc.page_of(chunk[0].into()), Owner::Tree)?;
            }
        }
        let mut locks: HashMap<usize, usize> = HashMap::new();
        let mut rows = vec![false; self.req_pool.size()];
        for (&id, r) in &self.reqs {
            if id >= self.next_req_id {
                return Err(broken(format!(
                    "request id {id} >= next id {}",
                    self.next_req_id
                )));
            }
            self.req_pool.check_span(r.req_pool_idx, 0, r.kv_len)?;
            if std::mem::replace(&mut rows[r.req_pool_idx], true) {
                return Err(broken(format!(
                    "row {} held by two requests",
                    r.req_pool_idx
                )));
            }
            if r.prefix_len > r.kv_len || r.prefix_len % ps != 0 {
                return Err(broken(format!(
                    "request {id}: prefix_len {} kv_len {}",
                    r.prefix_len, r.kv_len
                )));
            }
            let row: Vec<i64> = (self.req_pool.read(r.req_pool_idx, 0, r.kv_len)?.iter())
                .map(|&s| i64::from(s))
                .collect();
            self.tree.check_node(r.last_node)?;
            let mut path: Vec<usize> = self.tree.path_to_root(r.last_node).collect();
            path.reverse();
            let tree_slots: Vec<i64> = path
                .iter()
                .flat_map(|&n| self.tree.nodes[n].value.iter().map(i64::from))
                .collect();
            if tree_slots != row[..r.prefix_len] {
                return Err(broken(format!(
                    "request {id}: row prefix differs from its tree path"
                )));
            }
            for n in path {
                *locks.entry(n).or_default() += 1;
            }
            let own = &self.own[r.req_pool_idx];
            if !own.is_well_formed()
                || !own
                    .iter()
                    .map(i64::from)
                    .eq(row[r.prefix_len..].iter().copied())
            {
                return Err(broken(format!(
                    "request {id}: own slot runs differ from row [{}, {})",
                    r.prefix_len, r.kv_len
                )));
            }
            for (pos, &slot) in row.iter().enumerate().skip(r.prefix_len) {
                let page = self.alloc.page_of(slot);
                if slot < 0 || slot % ps as i64 != (pos % ps) as i64 {
                    return Err(broken(format!(
                        "request {id}: slot {slot} at position {pos}"
                    )));
                }
                if pos % ps == 0 || pos == r.prefix_len {
                    claim(&mut owner, page, Owner::Req(id))?;
                } else if owner.get(page as usize) != Some(&Owner::Req(id)) {
                    return Err(broken(format!(
                        "request {id}: slot {slot} outside its own page"
                    )));
                }
            }
        }
        if let Some(p) = owner.iter().skip(1).position(|o| *o == Owner::Nobody) {
            return Err(broken(format!(
                "page {} leaked: neither free nor held",
                p + 1
            )));
        }
        for (id, n) in self.tree.nodes.iter().enumerate().filter(|(_, n)| n.live) {
            let want = if id == ROOT {
                0
            } else {
                locks.get(&id).copied().unwrap_or(0)
            };
            if n.lock_ref != want {
                return Err(broken(format!(
                    "node {id} lock_ref {} != {want} requests",
                    n.lock_ref
                )));
            }
        }
        let used_rows = self.req_pool.size() - self.req_pool.available_size();
        if used_rows != self.reqs.len() {
            return Err(broken(format!(
                "{used_rows} rows in use for {} requests",
                self.reqs.len()
            )));
        }
        Ok(())
    }
}
