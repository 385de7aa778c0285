//! Random differential test of the page allocator against a naive model:
//! alloc / free (random slot lists, with repeats, out-of-range and already-free slots) /
//! free_slot_runs / free_page_runs; errors must change nothing, successes must append the
//! pages to the FIFO free list in order.

use std::collections::VecDeque;

use proptest::prelude::*;
use pyserve_core::allocator::TokenToKVPoolAllocator;
use pyserve_core::slot_runs::SlotRuns;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u16),
    Free(Vec<(u16, u8)>),
    FreeRuns(Vec<(u16, u8)>),
    FreePageRuns(Vec<(u16, u8)>),
}

fn op() -> impl Strategy<Value = Op> {
    let picks = || prop::collection::vec((any::<u16>(), any::<u8>()), 0..8);
    prop_oneof![
        2 => any::<u16>().prop_map(Op::Alloc),
        2 => picks().prop_map(Op::Free),
        2 => picks().prop_map(Op::FreeRuns),
        1 => picks().prop_map(Op::FreePageRuns),
    ]
}

fn state(a: &TokenToKVPoolAllocator) -> (Vec<u32>, usize, Vec<bool>) {
    (
        a.free_page_list().collect(),
        a.available_pages(),
        (0..=a.num_pages() as u32 + 130)
            .map(|p| a.is_page_free(p))
            .collect(),
    )
}

fn run(ps: usize, num_pages: usize, ops: Vec<Op>) {
    let mut a = TokenToKVPoolAllocator::new(num_pages * ps, ps).unwrap();
    let mut free: VecDeque<u32> = (1..=num_pages as u32).collect();
    let mut used: Vec<u32> = Vec::new(); // allocated pages in allocation order
    let check = |a: &TokenToKVPoolAllocator, free: &VecDeque<u32>| {
        let (list, n, bits) = state(a);
        assert_eq!(list, free.iter().copied().collect::<Vec<_>>());
        assert_eq!(n, free.len());
        for p in 0..=num_pages as u32 + 130 {
            let want = p >= 1 && p as usize <= num_pages && free.contains(&p);
            assert_eq!(bits[p as usize], want, "page {p}");
        }
    };
    for op in ops {
        let before = state(&a);
        let op_kind = match &op {
            Op::Free(_) => 1,
            Op::FreeRuns(_) => 2,
            _ => 3,
        };
        // The slots the op frees, and the model's verdict.
        let (res, pages): (Result<(), _>, Option<Vec<u32>>) = match op {
            Op::Alloc(n) => {
                let n = n as usize % (num_pages * ps + 2);
                let got = a.alloc(n);
                let np = n.div_ceil(ps);
                if np > free.len() {
                    assert_eq!(got, None);
                    assert_eq!(state(&a), before);
                } else {
                    let pages: Vec<u32> = free.drain(..np).collect();
                    let want: Vec<i64> = pages
                        .iter()
                        .flat_map(|&p| (p as i64 * ps as i64)..(p as i64 + 1) * ps as i64)
                        .take(n)
                        .collect();
                    assert_eq!(got, Some(want));
                    used.extend(pages);
                }
                check(&a, &free);
                continue;
            }
            Op::Free(picks) => {
                // slots: mostly from used pages, sometimes free / out of range / slot 0
                let mut slots: Vec<i64> = Vec::new();
                for (i, off) in picks {
                    let s = match off % 11 {
                        0 => (i as i64) % ((num_pages as i64 + 3) * ps as i64) - ps as i64,
                        _ if !used.is_empty() => {
                            let p = used[i as usize % used.len()];
                            p as i64 * ps as i64 + (off as i64 % ps as i64)
                        }
                        _ => i as i64 % ((num_pages as i64 + 1) * ps as i64),
                    };
                    // whole page in order sometimes
                    if off % 5 == 1 {
                        let p = s.div_euclid(ps as i64);
                        slots.extend(p * ps as i64..(p + 1) * ps as i64);
                    } else {
                        slots.push(s);
                    }
                }
                // model
                let hi = (num_pages as i64 + 1) * ps as i64;
                let mut ok = slots.iter().all(|&s| s >= ps as i64 && s < hi);
                let mut pages: Vec<u32> = Vec::new();
                if ok {
                    let mut i = 0;
                    while i < slots.len() {
                        let p = (slots[i] / ps as i64) as u32;
                        let mut j = i + 1;
                        while j < slots.len()
                            && slots[j] / ps as i64 == p as i64
                            && slots[j] > slots[j - 1]
                        {
                            j += 1;
                        }
                        if pages.contains(&p) || free.contains(&p) {
                            ok = false;
                        }
                        pages.push(p);
                        i = j;
                    }
                }
                (a.free(&slots), ok.then_some(pages))
            }
            Op::FreeRuns(picks) => {
                let mut runs = SlotRuns::new();
                let mut pages: Vec<u32> = Vec::new();
                let mut ok = true;
                let mut last: Option<u32> = None;
                for (i, off) in picks {
                    let p = if off % 7 == 0 || used.is_empty() {
                        (i as u32) % (num_pages as u32 + 2)
                    } else {
                        used[i as usize % used.len()]
                    };
                    let k = 1 + (off as u32 / 7) % 3; // pages in the run
                    let part = off as u32 % ps as u32; // start inside the page (tail runs)
                    let first = p * ps as u32 + part;
                    let len = k * ps as u32 - part - (off as u32 / 3) % (ps as u32 - part).max(1);
                    let len = len.max(1);
                    let lo = first / ps as u32;
                    let hi = (first + len - 1) / ps as u32;
                    for q in lo..=hi {
                        if q == 0 || q as usize > num_pages || free.contains(&q) {
                            ok = false;
                        }
                        if pages.contains(&q)
                            && !(Some(q) == last
                                && q == lo
                                && runs.runs().last().is_some_and(|r| r.0 + r.1 == first))
                        {
                            ok = false;
                        }
                        if !pages.contains(&q) {
                            pages.push(q);
                        }
                    }
                    last = Some(hi);
                    runs.push_run(first, len);
                }
                // a page covered by two runs that runs merged into one is still one run
                (a.free_slot_runs(&runs), ok.then_some(pages))
            }
            Op::FreePageRuns(picks) => {
                let mut runs: Vec<(u32, u32)> = Vec::new();
                let mut pages: Vec<u32> = Vec::new();
                let mut ok = true;
                for (i, off) in picks {
                    let p = if off % 7 == 0 || used.is_empty() {
                        (i as u32) % (num_pages as u32 + 2)
                    } else {
                        used[i as usize % used.len()]
                    };
                    let c = (off as u32 / 7) % 3;
                    for q in p..p + c {
                        if q == 0
                            || q as usize > num_pages
                            || free.contains(&q)
                            || pages.contains(&q)
                        {
                            ok = false;
                        }
                        pages.push(q);
                    }
                    runs.push((p, c));
                }
                (a.free_page_runs(&runs), ok.then_some(pages))
            }
        };
        if std::env::var_os("ALLOC_STATS").is_some() {
            eprintln!("STAT {} {}", op_kind, res.is_ok());
        }
        match (&res, pages) {
            (Ok(()), Some(pages)) => {
                for p in &pages {
                    used.retain(|u| u != p);
                    free.push_back(*p);
                }
            }
            (Err(_), None) => assert_eq!(state(&a), before, "error changed the allocator"),
            (r, m) => panic!("allocator said {r:?}, model said {m:?}"),
        }
        check(&a, &free);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn alloc_ps1(ops in prop::collection::vec(op(), 60)) { run(1, 150, ops) }
    #[test]
    fn alloc_ps2(ops in prop::collection::vec(op(), 60)) { run(2, 70, ops) }
    #[test]
    fn alloc_ps3(ops in prop::collection::vec(op(), 60)) { run(3, 130, ops) }
    #[test]
    fn alloc_ps16(ops in prop::collection::vec(op(), 60)) { run(16, 9, ops) }
}
