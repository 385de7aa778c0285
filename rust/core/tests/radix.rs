//! Tree operations of RadixCache: match, insert, split, lock, evict, reset.

use pyserve_core::{CoreError, RadixCache, SlotRuns, TokenToKVPoolAllocator, ROOT};

fn cache() -> RadixCache {
    RadixCache::new(1, false).unwrap()
}

#[test]
fn page_size_zero_is_rejected() {
    assert!(matches!(
        RadixCache::new(0, false),
        Err(CoreError::ShapeMismatch(_))
    ));
}

#[test]
fn paged_keys_match_and_split_at_page_boundaries() {
    let mut c = RadixCache::new(4, false).unwrap();
    let slots: Vec<i64> = (4..16).collect(); // pages 1, 2, 3
                                             // 11 tokens: only the first 8 (two whole pages) are cached.
    assert_eq!(
        c.insert(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], &slots[..11])
            .unwrap(),
        0
    );
    assert_eq!(c.total_size(), 8);
    // A match diverging inside the second page stops at the first page boundary.
    let m = c.match_prefix(&[1, 2, 3, 4, 5, 6, 0, 8, 9]);
    assert_eq!(m.indices, vec![4, 5, 6, 7]);
    assert_eq!(c.num_nodes(), 3);
    // Fewer than a page of tokens never matches.
    assert_eq!(c.match_prefix(&[1, 2, 3]).indices, Vec::<i64>::new());
    // A sibling under the first page: already-cached length is page-aligned.
    assert_eq!(
        c.insert(&[1, 2, 3, 4, 5, 6, 0, 0], &[20, 21, 22, 23, 12, 13, 14, 15])
            .unwrap(),
        4
    );
    assert_eq!(c.total_size(), 12);
    assert_eq!(
        c.match_prefix(&[1, 2, 3, 4, 5, 6, 0, 0, 1]).indices,
        vec![4, 5, 6, 7, 12, 13, 14, 15]
    );
    c.check_integrity().unwrap();
}

#[test]
fn evict_frees_whole_pages_lru_first() {
    let mut a = TokenToKVPoolAllocator::new(16, 4).unwrap();
    let mut c = RadixCache::new(4, false).unwrap();
    let x = a.alloc(8).unwrap(); // slots 4..12
    let y = a.alloc(4).unwrap(); // slots 12..16
    c.insert(&[1, 1, 1, 1, 2, 2, 2, 2], &x).unwrap();
    c.insert(&[3, 3, 3, 3], &y).unwrap();
    c.match_prefix(&[1, 1, 1, 1, 2, 2, 2, 2]); // [3 3 3 3] is now the LRU leaf
    assert_eq!(c.evict(1, &mut a).unwrap(), 4);
    assert!(a.is_free(12) && !a.is_free(4));
    assert_eq!(c.evict(100, &mut a).unwrap(), 8);
    assert_eq!(
        (a.available_size(), c.total_size(), c.num_nodes()),
        (16, 0, 1)
    );
    c.check_integrity().unwrap();
}

#[test]
fn match_after_insert_returns_exact_slots() {
    let mut c = cache();
    assert_eq!(c.insert(&[1, 2, 3], &[10, 11, 12]).unwrap(), 0);
    let m = c.match_prefix(&[1, 2, 3, 4]);
    assert_eq!(m.indices, vec![10, 11, 12]);
    assert_ne!(m.last_node, ROOT);
    let miss = c.match_prefix(&[7, 1]);
    assert_eq!((miss.indices.len(), miss.last_node), (0, ROOT));
    assert_eq!(c.match_prefix(&[]).last_node, ROOT);
    assert_eq!(
        (c.evictable_size(), c.protected_size(), c.total_size()),
        (3, 0, 3)
    );
    c.check_integrity().unwrap();
}

#[test]
fn match_inside_a_node_splits_it_and_keeps_the_deeper_id() {
    let mut c = cache();
    c.insert(&[1, 2, 3, 4], &[10, 11, 12, 13]).unwrap();
    let full = c.match_prefix(&[1, 2, 3, 4]).last_node;
    assert_eq!(c.num_nodes(), 2);
    let m = c.match_prefix(&[1, 2, 9]);
    assert_eq!(m.indices, vec![10, 11]);
    assert_ne!(m.last_node, full);
    assert_eq!(c.num_nodes(), 3);
    // The old id still names the full path's last node.
    let again = c.match_prefix(&[1, 2, 3, 4]);
    assert_eq!(
        (again.indices, again.last_node),
        (vec![10, 11, 12, 13], full)
    );
    assert_eq!(c.total_size(), 4);
    c.check_integrity().unwrap();
}

#[test]
fn insert_reports_already_cached_length() {
    let mut c = cache();
    assert_eq!(c.insert(&[1, 2, 3], &[10, 11, 12]).unwrap(), 0);
    assert_eq!(c.insert(&[1, 2, 3, 4], &[20, 21, 22, 23]).unwrap(), 3);
    assert_eq!(c.insert(&[1, 2, 5], &[30, 31, 32]).unwrap(), 2);
    assert_eq!(c.insert(&[1, 2], &[40, 41]).unwrap(), 2);
    assert_eq!(c.insert(&[], &[]).unwrap(), 0);
    // The tree keeps its own slots for the shared part.
    assert_eq!(c.match_prefix(&[1, 2, 3, 4]).indices, vec![10, 11, 12, 23]);
    assert_eq!(c.match_prefix(&[1, 2, 5]).indices, vec![10, 11, 32]);
    assert_eq!(c.total_size(), 5);
    assert!(matches!(
        c.insert(&[1], &[1, 2]),
        Err(CoreError::ShapeMismatch(_))
    ));
    c.check_integrity().unwrap();
}

#[test]
fn lock_moves_tokens_between_evictable_and_protected() {
    let mut c = cache();
    c.insert(&[1, 2, 3], &[10, 11, 12]).unwrap();
    c.insert(&[1, 2, 4, 5], &[10, 11, 13, 14]).unwrap();
    let a = c.match_prefix(&[1, 2, 3]).last_node;
    let b = c.match_prefix(&[1, 2, 4, 5]).last_node;
    c.inc_lock_ref(a).unwrap();
    assert_eq!((c.evictable_size(), c.protected_size()), (2, 3));
    c.inc_lock_ref(b).unwrap();
    assert_eq!((c.evictable_size(), c.protected_size()), (0, 5));
    c.inc_lock_ref(a).unwrap();
    assert_eq!(c.lock_ref(a).unwrap(), 2);
    c.check_integrity().unwrap();
    c.dec_lock_ref(a).unwrap();
    c.dec_lock_ref(a).unwrap();
    assert_eq!((c.evictable_size(), c.protected_size()), (1, 4));
    assert_eq!(c.dec_lock_ref(a), Err(CoreError::LockUnderflow(a)));
    c.dec_lock_ref(b).unwrap();
    assert_eq!((c.evictable_size(), c.protected_size()), (5, 0));
    assert_eq!(c.inc_lock_ref(999), Err(CoreError::UnknownNode(999)));
    assert_eq!(c.dec_lock_ref(999), Err(CoreError::UnknownNode(999)));
    c.inc_lock_ref(ROOT).unwrap();
    c.dec_lock_ref(ROOT).unwrap();
    c.check_integrity().unwrap();
}

#[test]
fn evict_is_lru_and_skips_locked_nodes() {
    let mut alloc = TokenToKVPoolAllocator::new(10, 1).unwrap();
    let mut c = cache();
    let a = alloc.alloc(3).unwrap(); // 1 2 3
    let b = alloc.alloc(2).unwrap(); // 4 5
    let x = alloc.alloc(3).unwrap(); // 6 7 8
    c.insert(&[1, 2, 3], &a).unwrap();
    c.insert(&[4, 5], &b).unwrap();
    assert_eq!(c.insert(&[1, 2, 9], &x).unwrap(), 2);
    alloc.free(&x[..2]).unwrap(); // duplicates of [1, 2]
    assert_eq!(alloc.available_size(), 4);
    c.match_prefix(&[4, 5]); // [4, 5] becomes the most recent leaf
                             // Leaf [3] (slot 3) is the oldest.
    assert_eq!(c.evict(1, &mut alloc).unwrap(), 1);
    assert_eq!(alloc.available_size(), 5);
    assert!(alloc.is_free(3));
    assert_eq!(c.match_prefix(&[1, 2, 3]).indices, vec![1, 2]);
    // Lock [1, 2, 9]; only [4, 5] may go.
    let n9 = c.match_prefix(&[1, 2, 9]).last_node;
    c.inc_lock_ref(n9).unwrap();
    assert_eq!(c.evict(100, &mut alloc).unwrap(), 2);
    assert_eq!(alloc.available_size(), 7);
    assert!(alloc.is_free(4) && alloc.is_free(5));
    assert_eq!((c.evictable_size(), c.protected_size()), (0, 3));
    c.check_integrity().unwrap();
    // Unlocked, the leaf goes first and then its parent becomes a leaf and goes too.
    c.dec_lock_ref(n9).unwrap();
    assert_eq!(c.evict(2, &mut alloc).unwrap(), 3);
    assert_eq!(
        (c.total_size(), c.num_nodes(), alloc.available_size()),
        (0, 1, 10)
    );
    assert_eq!(c.evict(5, &mut alloc).unwrap(), 0);
    c.check_integrity().unwrap();
}

#[test]
fn evict_prefers_older_access() {
    let mut alloc = TokenToKVPoolAllocator::new(4, 1).unwrap();
    let mut c = cache();
    c.insert(&[1], &alloc.alloc(1).unwrap()).unwrap(); // slot 1
    c.insert(&[2], &alloc.alloc(1).unwrap()).unwrap(); // slot 2
    c.insert(&[3], &alloc.alloc(1).unwrap()).unwrap(); // slot 3
    c.match_prefix(&[1]);
    assert_eq!(c.evict(1, &mut alloc).unwrap(), 1);
    assert!(alloc.is_free(2));
    assert_eq!(c.evict(1, &mut alloc).unwrap(), 1);
    assert!(alloc.is_free(3));
    assert_eq!(c.match_prefix(&[1]).indices, vec![1]);
}

#[test]
fn insert_below_continues_a_nodes_path() {
    let runs = |s: &[i64]| SlotRuns::from_slots(s);
    let mut c = cache();
    c.insert(&[1, 2, 3], &[11, 12, 13]).unwrap();
    let n = c.match_prefix(&[1, 2]).last_node; // splits [1 2 | 3]
                                               // Below [1, 2]: [3] is cached already (slot 23 comes back), [4, 5] is new.
    let (cached, not_taken) = c.insert_below(n, &[3, 4, 5], runs(&[23, 24, 25])).unwrap();
    assert_eq!((cached, not_taken), (1, runs(&[23])));
    assert_eq!(
        c.match_prefix(&[1, 2, 3, 4, 5, 6]).indices,
        vec![11, 12, 13, 24, 25]
    );
    assert_eq!(
        c.insert_below(ROOT, &[7], runs(&[17])).unwrap(),
        (0, SlotRuns::new())
    );
    assert_eq!(c.total_size(), 6);
    assert_eq!(
        c.insert_below(99, &[1], runs(&[1])),
        Err(CoreError::UnknownNode(99))
    );
    assert!(matches!(
        c.insert_below(n, &[3], SlotRuns::new()),
        Err(CoreError::ShapeMismatch(_))
    ));
    let mut paged = RadixCache::new(2, false).unwrap();
    assert!(matches!(
        paged.insert_below(ROOT, &[1, 2, 3], runs(&[4, 5, 6])),
        Err(CoreError::ShapeMismatch(_))
    ));
    c.check_integrity().unwrap();
}

#[test]
fn reset_frees_everything() {
    let mut alloc = TokenToKVPoolAllocator::new(6, 1).unwrap();
    let mut c = cache();
    c.insert(&[1, 2, 3], &alloc.alloc(3).unwrap()).unwrap();
    c.insert(&[1, 5], &alloc.alloc(2).unwrap()).unwrap();
    alloc.free(&[4]).unwrap();
    let n = c.match_prefix(&[1, 5]).last_node;
    c.inc_lock_ref(n).unwrap();
    c.reset(&mut alloc).unwrap();
    assert_eq!(
        (c.total_size(), c.num_nodes(), alloc.available_size()),
        (0, 1, 6)
    );
    assert_eq!(c.match_prefix(&[1, 2]).indices, Vec::<i64>::new());
    c.check_integrity().unwrap();
}

#[test]
fn disabled_cache_stores_nothing() {
    let mut c = RadixCache::new(1, true).unwrap();
    assert!(c.disabled());
    assert_eq!(c.insert(&[1, 2], &[5, 6]).unwrap(), 0);
    let m = c.match_prefix(&[1, 2]);
    assert_eq!((m.indices.len(), m.last_node), (0, ROOT));
    assert_eq!(c.total_size(), 0);
    c.check_integrity().unwrap();
}
