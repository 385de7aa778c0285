//! Request lifecycle calls and batch bookkeeping, with exact slot accounting.

use pyserve_core::{
    prepare_decode, prepare_extend, CoreError, RadixCache, ReqToTokenPool, TokenToKVPoolAllocator,
    ROOT,
};

struct Env {
    cache: RadixCache,
    pool: ReqToTokenPool,
    alloc: TokenToKVPoolAllocator,
}

impl Env {
    fn new(disable: bool) -> Self {
        Self {
            cache: RadixCache::new(1, disable).unwrap(),
            pool: ReqToTokenPool::new(4, 16),
            alloc: TokenToKVPoolAllocator::new(20),
        }
    }

    /// Admits a request: match, lock, take a row, write the prefix, extend the rest.
    /// Returns (row, prefix_len, last_node).
    fn admit(&mut self, tokens: &[i32]) -> (usize, usize, usize) {
        let m = self.cache.match_prefix(tokens);
        self.cache.inc_lock_ref(m.last_node).unwrap();
        let row = self.pool.alloc().unwrap();
        self.pool.write(row, 0, &m.indices).unwrap();
        let p = m.indices.len();
        prepare_extend(
            &mut self.pool,
            &mut self.alloc,
            &[row],
            &[p],
            &[tokens.len() - p],
        )
        .unwrap()
        .unwrap();
        (row, p, m.last_node)
    }

    fn finish(&mut self, row: usize, tokens: &[i32], prefix: usize, node: usize) {
        let (c, p, a) = (&mut self.cache, &mut self.pool, &mut self.alloc);
        c.cache_finished_req(p, a, row, tokens, prefix, node)
            .unwrap();
        c.check_integrity().unwrap();
    }
}

#[test]
fn prepare_extend_and_decode_exact_arrays() {
    let mut e = Env::new(false);
    let r0 = e.pool.alloc().unwrap();
    let r1 = e.pool.alloc().unwrap();
    e.pool.write(r1, 0, &[17, 18]).unwrap(); // a cached prefix of 2 tokens
    let x = prepare_extend(&mut e.pool, &mut e.alloc, &[r0, r1], &[0, 2], &[3, 2])
        .unwrap()
        .unwrap();
    assert_eq!(x.out_cache_loc, vec![1, 2, 3, 4, 5]);
    assert_eq!(x.positions, vec![0, 1, 2, 2, 3]);
    assert_eq!(x.kv_indptr, vec![0, 3, 7]);
    assert_eq!(x.kv_indices, vec![1, 2, 3, 17, 18, 4, 5]);
    let d = prepare_decode(&mut e.pool, &mut e.alloc, &[r1, r0], &[4, 3])
        .unwrap()
        .unwrap();
    assert_eq!(d.out_cache_loc, vec![6, 7]);
    assert_eq!(d.positions, vec![4, 3]);
    assert_eq!(d.kv_indptr, vec![0, 5, 9]);
    assert_eq!(d.kv_indices, vec![17, 18, 4, 5, 6, 1, 2, 3, 7]);
    assert_eq!(e.alloc.available_size(), 13);
    // Not enough slots: None, and nothing changed.
    let none = prepare_extend(&mut e.pool, &mut e.alloc, &[r0], &[0], &[14]).unwrap();
    assert!(none.is_none());
    assert_eq!(e.alloc.available_size(), 13);
    assert_eq!(e.pool.read(r0, 0, 5).unwrap(), &[1, 2, 3, 7, 0]);
    // Errors, checked before allocating.
    let bad = prepare_extend(&mut e.pool, &mut e.alloc, &[r0], &[0, 1], &[1]);
    assert!(matches!(bad, Err(CoreError::ShapeMismatch(_))));
    let dup = prepare_decode(&mut e.pool, &mut e.alloc, &[r0, r0], &[4, 4]);
    assert!(matches!(dup, Err(CoreError::ShapeMismatch(_))));
    let unk = prepare_decode(&mut e.pool, &mut e.alloc, &[3], &[0]);
    assert_eq!(unk, Err(CoreError::UnknownReqSlot(3)));
    let far = prepare_decode(&mut e.pool, &mut e.alloc, &[r0], &[16]);
    assert!(matches!(far, Err(CoreError::OutOfRange { .. })));
    assert_eq!(e.alloc.available_size(), 13);
    let empty = prepare_decode(&mut e.pool, &mut e.alloc, &[], &[])
        .unwrap()
        .unwrap();
    assert_eq!((empty.kv_indptr, empty.out_cache_loc.len()), (vec![0], 0));
}

#[test]
fn finished_requests_share_prefix_and_free_exact_duplicates() {
    let mut e = Env::new(false);
    let (ra, pa, na) = e.admit(&[1, 2, 3, 4]);
    assert_eq!((pa, na), (0, ROOT));
    e.finish(ra, &[1, 2, 3, 4], pa, na);
    assert_eq!((e.alloc.available_size(), e.pool.available_size()), (16, 4));
    assert_eq!(e.cache.evictable_size(), 4);

    // B reuses A's prefix and decodes one token.
    let (rb, pb, nb) = e.admit(&[1, 2, 3, 4, 5, 6]);
    assert_eq!(pb, 4);
    assert_eq!(e.cache.protected_size(), 4);
    let d = prepare_decode(&mut e.pool, &mut e.alloc, &[rb], &[6])
        .unwrap()
        .unwrap();
    assert_eq!(d.kv_indices, vec![1, 2, 3, 4, 5, 6, 7]);
    e.finish(rb, &[1, 2, 3, 4, 5, 6, 70], pb, nb);
    assert_eq!(e.alloc.available_size(), 13);
    assert_eq!((e.cache.evictable_size(), e.cache.protected_size()), (7, 0));

    // C and D compute the same new prompt concurrently; D's copy is the duplicate.
    let (rc, pc, nc) = e.admit(&[8, 9, 10]);
    let (rd, pd, nd) = e.admit(&[8, 9, 10, 11]);
    assert_eq!(e.alloc.available_size(), 6);
    e.finish(rc, &[8, 9, 10], pc, nc);
    assert_eq!(e.alloc.available_size(), 6);
    e.finish(rd, &[8, 9, 10, 11], pd, nd);
    assert_eq!(e.alloc.available_size(), 9); // D's slots for [8, 9, 10] went back
    assert_eq!(e.cache.total_size(), 11);
    assert_eq!(
        e.cache.match_prefix(&[8, 9, 10, 11]).indices,
        vec![8, 9, 10, 14]
    );
}

#[test]
fn unfinished_req_relocks_and_rewrites_row() {
    let mut e = Env::new(false);
    // E: chunked prefill of [11..=16] in chunks of 3.
    let (re, _, _) = e.admit(&[11, 12, 13]);
    let (p, n1) = {
        let (c, pl, a) = (&mut e.cache, &mut e.pool, &mut e.alloc);
        c.cache_unfinished_req(pl, a, re, &[11, 12, 13], 0, ROOT)
            .unwrap()
    };
    assert_eq!(p, 3);
    assert_eq!(e.cache.lock_ref(n1).unwrap(), 1);
    assert_eq!((e.cache.evictable_size(), e.cache.protected_size()), (0, 3));

    // F computed [11, 12, 13, 20] without the cache; its first three slots are duplicates.
    let rf = e.pool.alloc().unwrap();
    prepare_extend(&mut e.pool, &mut e.alloc, &[rf], &[0], &[4])
        .unwrap()
        .unwrap();
    assert_eq!(e.pool.read(rf, 0, 4).unwrap(), &[4, 5, 6, 7]);
    assert_eq!(e.alloc.available_size(), 13);
    let (pf, nf) = {
        let (c, pl, a) = (&mut e.cache, &mut e.pool, &mut e.alloc);
        c.cache_unfinished_req(pl, a, rf, &[11, 12, 13, 20], 0, ROOT)
            .unwrap()
    };
    assert_eq!(pf, 4);
    assert_eq!(e.pool.read(rf, 0, 4).unwrap(), &[1, 2, 3, 7]);
    assert_eq!(e.alloc.available_size(), 16);
    assert_eq!((e.cache.evictable_size(), e.cache.protected_size()), (0, 4));
    e.cache.check_integrity().unwrap();

    // E's second chunk, then E finishes; F is aborted after one more token.
    prepare_extend(&mut e.pool, &mut e.alloc, &[re], &[3], &[3])
        .unwrap()
        .unwrap();
    e.finish(re, &[11, 12, 13, 14, 15, 16], 3, n1);
    assert_eq!(e.alloc.available_size(), 13);
    prepare_decode(&mut e.pool, &mut e.alloc, &[rf], &[4])
        .unwrap()
        .unwrap();
    assert_eq!(e.alloc.available_size(), 12);
    let (c, pl, a) = (&mut e.cache, &mut e.pool, &mut e.alloc);
    c.release_req(pl, a, rf, 5, pf, nf).unwrap();
    assert_eq!((a.available_size(), pl.available_size()), (13, 4));
    assert_eq!((c.evictable_size(), c.protected_size()), (7, 0));
    c.check_integrity().unwrap();
}

#[test]
fn lifecycle_errors_change_nothing() {
    let mut e = Env::new(false);
    let (r, p, n) = e.admit(&[1, 2]);
    let (c, pl, a) = (&mut e.cache, &mut e.pool, &mut e.alloc);
    assert_eq!(
        c.cache_finished_req(pl, a, r, &[1, 2], p, 42),
        Err(CoreError::UnknownNode(42))
    );
    assert_eq!(
        c.cache_finished_req(pl, a, 3, &[1, 2], p, n),
        Err(CoreError::UnknownReqSlot(3))
    );
    assert!(matches!(
        c.cache_finished_req(pl, a, r, &[1, 2], 3, n),
        Err(CoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        c.cache_finished_req(pl, a, r, &[1, 2, 3], p, n),
        Err(CoreError::Invariant(_))
    ));
    assert_eq!(
        (a.available_size(), pl.available_size(), c.total_size()),
        (18, 3, 0)
    );
    c.cache_finished_req(pl, a, r, &[1, 2], p, n).unwrap();
    let node = c.match_prefix(&[1, 2]).last_node;
    let r2 = pl.alloc().unwrap();
    assert_eq!(
        c.release_req(pl, a, r2, 0, 0, node),
        Err(CoreError::LockUnderflow(node))
    );
    assert_eq!(pl.available_size(), 3);
}

#[test]
fn disabled_cache_lifecycle() {
    let mut e = Env::new(true);
    let (r, p, n) = e.admit(&[1, 2, 3]);
    assert_eq!((p, n), (0, ROOT));
    let (np, nn) = {
        let (c, pl, a) = (&mut e.cache, &mut e.pool, &mut e.alloc);
        c.cache_unfinished_req(pl, a, r, &[1, 2, 3], 0, ROOT)
            .unwrap()
    };
    assert_eq!((np, nn), (3, ROOT));
    assert_eq!(e.alloc.available_size(), 17);
    prepare_extend(&mut e.pool, &mut e.alloc, &[r], &[3], &[2])
        .unwrap()
        .unwrap();
    e.finish(r, &[1, 2, 3, 4, 5], 0, ROOT);
    assert_eq!((e.alloc.available_size(), e.pool.available_size()), (20, 4));
    assert_eq!(e.cache.total_size(), 0);
}
