//! KVCache: the request lifecycle and the per-step arrays, with exact slots, for page sizes
//! 1 and 4. `check_integrity` runs after every operation.

use pyserve_core::{BatchArrays, CoreError, KVCache, ROOT};

fn kv(size: usize, page_size: usize) -> KVCache {
    KVCache::new(size, page_size, 4, 32, false).unwrap()
}

fn ok(c: &KVCache) {
    c.check_integrity().unwrap();
}

fn add(c: &mut KVCache, key: &[i32]) -> u64 {
    let r = c.add_req(key).unwrap().unwrap();
    ok(c);
    r.req_id
}

fn extend(c: &mut KVCache, ids: &[u64], lens: &[usize]) -> BatchArrays {
    let a = c.prepare_extend(ids, lens).unwrap().unwrap();
    ok(c);
    a
}

#[test]
fn extend_and_decode_exact_arrays_page_size_1() {
    let mut c = kv(20, 1);
    let r0 = add(&mut c, &[]);
    let r1 = add(&mut c, &[]);
    let a = extend(&mut c, &[r0, r1], &[3, 2]);
    assert_eq!(a.req_pool_indices, vec![0, 1]);
    assert_eq!(
        (
            a.prefix_lens.clone(),
            a.extend_lens.clone(),
            a.seq_lens.clone()
        ),
        (vec![0, 0], vec![3, 2], vec![3, 2])
    );
    assert_eq!(a.out_cache_loc, vec![1, 2, 3, 4, 5]);
    assert_eq!(a.positions, vec![0, 1, 2, 0, 1]);
    assert_eq!(a.kv_indptr, vec![0, 3, 5]);
    assert_eq!(a.kv_indices, vec![1, 2, 3, 4, 5]);
    let d = c.prepare_decode(&[r1, r0]).unwrap().unwrap();
    ok(&c);
    assert_eq!(d.out_cache_loc, vec![6, 7]);
    assert_eq!(d.positions, vec![2, 3]);
    assert_eq!(d.prefix_lens, vec![2, 3]);
    assert_eq!(d.extend_lens, vec![1, 1]);
    assert_eq!(d.seq_lens, vec![3, 4]);
    // decode is O(batch): the rows are not copied out (the worker holds them)
    assert!(d.kv_indptr.is_empty() && d.kv_indices.is_empty());
    assert_eq!(c.req_slots(r1).unwrap(), vec![4, 5, 6]);
    assert_eq!(c.req_slots(r0).unwrap(), vec![1, 2, 3, 7]);
    assert_eq!(c.alloc.available_size(), 13);
    assert_eq!(c.prepare_extend(&[r0], &[14]).unwrap(), None);
    assert_eq!(c.alloc.available_size(), 13);
    assert_eq!(
        c.prepare_extend(&[r0], &[1, 2]),
        Err(CoreError::ShapeMismatch(
            "2 extend_lens for 1 req_ids".into()
        ))
    );
    assert_eq!(
        c.prepare_decode(&[r0, r0]),
        Err(CoreError::DuplicateReq(r0))
    );
    assert_eq!(c.prepare_decode(&[77]), Err(CoreError::UnknownReq(77)));
    assert!(matches!(
        c.prepare_extend(&[r0], &[40]),
        Err(CoreError::OutOfRange { .. })
    ));
    ok(&c);
}

#[test]
fn pages_fill_the_partial_tail_first_and_decode_at_boundaries() {
    let mut c = kv(16, 4); // pages 1..=4: slots 4..20
    let r = add(&mut c, &[]);
    let a = extend(&mut c, &[r], &[6]);
    assert_eq!(a.out_cache_loc, vec![4, 5, 6, 7, 8, 9]);
    assert_eq!(c.alloc.available_pages(), 2);
    // The next chunk fills slots 10, 11 of page 2 before taking page 3.
    let b = extend(&mut c, &[r], &[3]);
    assert_eq!(b.out_cache_loc, vec![10, 11, 12]);
    assert_eq!(b.positions, vec![6, 7, 8]);
    assert_eq!(c.alloc.available_pages(), 1);
    // Decode: no new page until position 12.
    for (pos, slot) in [(9, 13), (10, 14), (11, 15)] {
        let d = c.prepare_decode(&[r]).unwrap().unwrap();
        ok(&c);
        assert_eq!((d.positions, d.out_cache_loc), (vec![pos], vec![slot]));
        assert_eq!(c.alloc.available_pages(), 1);
    }
    let d = c.prepare_decode(&[r]).unwrap().unwrap();
    assert_eq!(d.out_cache_loc, vec![16]);
    assert_eq!(c.alloc.available_pages(), 0);
    ok(&c);
}

#[test]
fn finish_caches_whole_pages_and_frees_the_partial_tail() {
    let mut c = kv(16, 4);
    let tokens: Vec<i32> = (100..110).collect(); // 10 tokens: 2 whole pages + 2
    let r = add(&mut c, &tokens[..9]);
    extend(&mut c, &[r], &[10]);
    assert!(c.cache_finished_req(r, &tokens).unwrap());
    ok(&c);
    assert_eq!((c.tree.total_size(), c.tree.evictable_size()), (8, 8));
    assert_eq!(c.alloc.available_pages(), 2); // the partial page 3 went back
                                              // Same prompt again: 8 of 9 key tokens hit (page-aligned), 2 new pages for 2 tokens? no:
                                              // one page for positions 8, 9.
    let r2 = c.add_req(&tokens[..9]).unwrap().unwrap();
    assert_eq!(r2.prefix_len, 8);
    assert_eq!(c.tree.protected_size(), 8);
    let a = extend(&mut c, &[r2.req_id], &[2]);
    assert_eq!((a.prefix_lens, a.positions), (vec![8], vec![8, 9]));
    assert_eq!(a.kv_indices, vec![4, 5, 6, 7, 8, 9, 10, 11, 16, 17]);
    // Idempotent: the second finish / abort changes nothing.
    assert!(c.free_req(r2.req_id).unwrap());
    assert!(!c.free_req(r2.req_id).unwrap());
    assert!(!c.cache_finished_req(r2.req_id, &tokens).unwrap());
    assert!(!c.cache_finished_req(r, &tokens).unwrap());
    assert_eq!(c.free_req(99), Err(CoreError::UnknownReq(99)));
    ok(&c);
    assert_eq!(c.alloc.available_pages() + c.tree.evictable_size() / 4, 4);
}

#[test]
fn concurrent_duplicates_are_freed_exactly() {
    let mut c = kv(20, 1);
    // C and D compute the same prompt concurrently (no cache hit for either).
    let rc = add(&mut c, &[8, 9]);
    let rd = add(&mut c, &[8, 9, 10]);
    extend(&mut c, &[rc, rd], &[3, 4]);
    assert_eq!(c.req_slots(rd).unwrap(), &[4, 5, 6, 7]);
    assert!(c.cache_finished_req(rc, &[8, 9, 10]).unwrap());
    ok(&c);
    assert!(c.cache_finished_req(rd, &[8, 9, 10, 11]).unwrap());
    ok(&c);
    assert_eq!(c.alloc.available_size(), 16); // D's 4 5 6 went back
    assert_eq!(c.match_prefix(&[8, 9, 10, 11]).indices, vec![1, 2, 3, 7]);
    assert_eq!(c.cache_finished_req(rc, &[1]), Ok(false));
}

#[test]
fn unfinished_req_relocks_and_keeps_its_partial_page() {
    let mut c = kv(32, 4);
    let r = add(&mut c, &[]);
    let tokens: Vec<i32> = (0..6).collect();
    extend(&mut c, &[r], &[6]);
    assert_eq!(c.cache_unfinished_req(r, &tokens).unwrap(), 4);
    ok(&c);
    let st = c.req(r).unwrap();
    assert_eq!((st.prefix_len, st.kv_len), (4, 6));
    assert_ne!(st.last_node, ROOT);
    assert_eq!((c.tree.protected_size(), c.tree.evictable_size()), (4, 0));
    let b = extend(&mut c, &[r], &[3]);
    assert_eq!(b.out_cache_loc, vec![10, 11, 12]);
    assert_eq!(
        c.cache_unfinished_req(r, &tokens),
        Err(CoreError::ShapeMismatch(
            "6 token ids given for a request with KV for 9 tokens".into()
        ))
    );
    assert!(c.free_req(r).unwrap());
    ok(&c);
    assert_eq!((c.tree.protected_size(), c.tree.evictable_size()), (0, 4));
    assert_eq!(c.alloc.available_pages(), 7);
}

#[test]
fn extend_evicts_when_short_and_returns_none_when_impossible() {
    let mut c = kv(8, 4);
    let r = add(&mut c, &[]);
    extend(&mut c, &[r], &[8]);
    let tokens: Vec<i32> = (0..8).collect();
    c.cache_finished_req(r, &tokens).unwrap();
    assert_eq!((c.alloc.available_pages(), c.tree.evictable_size()), (0, 8));
    let r2 = add(&mut c, &[50]);
    let a = extend(&mut c, &[r2], &[5]); // needs 2 pages: evicts the whole tree
    assert_eq!(a.out_cache_loc, vec![4, 5, 6, 7, 8]);
    assert_eq!(c.tree.total_size(), 0);
    assert_eq!(
        c.prepare_decode(&[r2]).unwrap().unwrap().out_cache_loc,
        vec![9]
    );
    let r3 = add(&mut c, &[]);
    assert_eq!(c.prepare_extend(&[r3], &[1]).unwrap(), None);
    ok(&c);
}

#[test]
fn disabled_cache_frees_everything_on_finish() {
    let mut c = KVCache::new(16, 4, 2, 16, true).unwrap();
    let r = add(&mut c, &[1, 2, 3, 4, 5]);
    assert_eq!(c.req(r).unwrap().prefix_len, 0);
    extend(&mut c, &[r], &[5]);
    assert_eq!(c.cache_unfinished_req(r, &[1, 2, 3, 4, 5]).unwrap(), 0);
    c.cache_finished_req(r, &[1, 2, 3, 4, 5]).unwrap();
    ok(&c);
    assert_eq!((c.alloc.available_size(), c.tree.total_size()), (16, 0));
}

#[test]
fn rows_run_out_and_constructor_errors() {
    let mut c = KVCache::new(16, 1, 1, 8, false).unwrap();
    add(&mut c, &[1]);
    assert_eq!(c.add_req(&[1]).unwrap(), None);
    assert!(matches!(
        c.add_req(&[0; 9]),
        Err(CoreError::OutOfRange { .. })
    ));
    assert!(matches!(
        KVCache::new(10, 4, 1, 8, false),
        Err(CoreError::ShapeMismatch(_))
    ));
    assert!(matches!(c.reset(), Err(CoreError::Invariant(_))));
}
