//! The KV page allocator: hands out whole pages of KV slots.
//!
//! A KV slot holds the keys and values of one token in every layer; a page is `page_size`
//! consecutive slots. Page `p` covers slots `p * page_size .. (p + 1) * page_size`. Page 0 is
//! reserved: its slot 0 is the padding slot (padded batch entries write there) and no slot of
//! page 0 is ever handed out. With `size` allocatable slots the pages are `1..=size /
//! page_size`, so the KV tensors need `size + page_size` rows ([`Self::num_slot_rows`]); with
//! `page_size = 1` that is the familiar `size + 1`.
//!
//! Allocation is first-in first-out over the free pages: a fresh allocator hands out pages
//! `1, 2, 3, ...` and a freed page is reused after every page freed before it, which makes
//! slot reuse exact and testable. The owner of a partly filled page (a request's last page)
//! holds the whole page; freeing any of its slots frees the page.
//!
//! The free list holds runs of consecutive pages, and the free-page bitset is updated a word
//! (64 pages) at a time, so freeing a long run (an evicted prompt) or taking one (a prefill)
//! costs per run, not per page.

use std::collections::VecDeque;

use crate::error::{CoreError, CoreResult};
use crate::slot_runs::SlotRuns;

/// Allocator of KV pages `1..=num_pages` (page 0, holding the padding slot 0, is reserved).
#[derive(Debug, Clone)]
pub struct TokenToKVPoolAllocator {
    page_size: usize,
    /// `log2(page_size)` when it is a power of two (then slot -> page is a shift).
    page_shift: Option<u32>,
    num_pages: usize,
    /// Free pages in hand-out order (front first), as `(first page, count)` runs.
    free_runs: VecDeque<(u32, u32)>,
    /// Number of free pages (the sum of the run counts).
    num_free: usize,
    /// Bit `p` is set when page `p` is free, for every page `0..=num_pages`; page 0 never is.
    /// A bitset rather than `Vec<bool>`: frees touch pages in whatever order the slots were
    /// recycled, and at 1/8 of the size the set stays in cache (1.7M pages: 212 KiB).
    page_free: Vec<u64>,
}

impl TokenToKVPoolAllocator {
    /// Creates an allocator of `size` slots (tokens) in pages of `page_size`, all free.
    ///
    /// Errors: [`CoreError::ShapeMismatch`] if `page_size == 0`, `size` is not a multiple of
    /// `page_size`, or a slot would not fit in `i32` (`size + page_size > i32::MAX`: request
    /// rows and `kv_indices` store slots as `i32`, the radix cache as `u32`).
    pub fn new(size: usize, page_size: usize) -> CoreResult<Self> {
        if page_size == 0
            || !size.is_multiple_of(page_size)
            || size.saturating_add(page_size) > i32::MAX as usize
        {
            return Err(CoreError::ShapeMismatch(format!(
                "KV pool of {size} slots cannot be split into pages of {page_size}"
            )));
        }
        let num_pages = size / page_size;
        // Bits past the last page stay set but are never read: pages are range-checked.
        let mut page_free = vec![u64::MAX; (num_pages + 1).div_ceil(64)];
        page_free[0] &= !1; // page 0 is reserved
        Ok(Self {
            page_size,
            page_shift: page_size
                .is_power_of_two()
                .then(|| page_size.trailing_zeros()),
            num_pages,
            free_runs: (num_pages > 0)
                .then_some((1, num_pages as u32))
                .into_iter()
                .collect(),
            num_free: num_pages,
            page_free,
        })
    }

    /// First slot of page `page`.
    #[inline]
    pub fn first_slot(&self, page: u32) -> i64 {
        page as i64 * self.page_size as i64
    }

    /// Page holding `slot` (no range check).
    #[inline]
    pub fn page_of(&self, slot: i64) -> u32 {
        match self.page_shift {
            Some(k) => (slot >> k) as u32,
            None => (slot / self.page_size as i64) as u32,
        }
    }

    /// Takes `n` free pages, oldest-freed first; `None`, changing nothing, if fewer are free.
    pub fn alloc_pages(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let front = self
                .free_runs
                .front_mut()
                .expect("num_free counts the runs");
            let take = (n - out.len()).min(front.1 as usize) as u32;
            let first = front.0;
            if take == front.1 {
                self.free_runs.pop_front();
            } else {
                front.0 += take;
                front.1 -= take;
            }
            self.mark_used(first, first + take);
            out.extend(first..first + take);
        }
        self.num_free -= n;
        Some(out)
    }

    /// Takes `ceil(n / page_size)` pages and returns the first `n` of their slots, page by
    /// page (the rest of the last page belongs to the caller too, unused). `None`, changing
    /// nothing, if too few pages are free. `alloc(0)` returns an empty vector.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<i64>> {
        let pages = self.alloc_pages(n.div_ceil(self.page_size))?;
        let ps = self.page_size as i64;
        let slots = pages.iter().flat_map(|&p| {
            let first = p as i64 * ps;
            first..first + ps
        });
        Some(slots.take(n).collect())
    }

    /// Frees the pages holding `slots`. A page's slots must appear as one run of increasing
    /// slots (as a request row lists them); any page of the run frees the whole page.
    ///
    /// Errors, with nothing freed: [`CoreError::OutOfRange`] if a slot is not in an
    /// allocatable page (slot 0 included); [`CoreError::DoubleFree`] if a page is already
    /// free, or a slot repeats, or a page's slots appear in two separate runs.
    pub fn free<S: Copy + Into<i64>>(&mut self, slots: &[S]) -> CoreResult<()> {
        if self.page_size == 1 {
            let high = self.num_pages as i64 + 1;
            if let Some(s) = slots
                .iter()
                .map(|&s| s.into())
                .find(|&s| s < 1 || s >= high)
            {
                return Err(CoreError::OutOfRange {
                    what: "kv slot",
                    value: s,
                    low: 1,
                    high,
                });
            }
            return self.free_page_runs(SlotRuns::from_slots(slots).runs());
        }
        let slots: Vec<i64> = slots.iter().map(|&s| s.into()).collect();
        let pages = self.pages_of_runs(&slots)?;
        self.free_pages_checked(&pages)
    }

    /// Frees the pages holding the slots of `slots` (see [`Self::free`]), one run at a time:
    /// each run of consecutive slots covers the pages from its first slot's to its last's.
    ///
    /// Errors, with nothing freed: [`CoreError::OutOfRange`] if a run leaves the allocatable
    /// pages; [`CoreError::DoubleFree`] if a page is already free or is covered twice.
    pub fn free_slot_runs(&mut self, slots: &SlotRuns) -> CoreResult<()> {
        if self.page_size == 1 {
            return self.free_page_runs(slots.runs());
        }
        let mut pages = SlotRuns::new();
        let mut last_page = None;
        for &(first, len) in slots.runs() {
            let (lo, hi) = (
                self.page_of(first.into()),
                self.page_of(i64::from(first) + i64::from(len) - 1),
            );
            if last_page == Some(lo) {
                return Err(CoreError::DoubleFree(first.into())); // a page in two runs
            }
            pages.push_run(lo, hi - lo + 1);
            last_page = Some(hi);
        }
        self.free_page_runs(pages.runs())
    }

    /// Frees `(first page, count)` runs of pages, appending them to the free list in order.
    ///
    /// Errors, with nothing freed: [`CoreError::OutOfRange`] for page 0 or a page past the
    /// end, [`CoreError::DoubleFree`] for a page already free or repeated (reported as the
    /// page's first slot).
    pub fn free_page_runs(&mut self, runs: &[(u32, u32)]) -> CoreResult<()> {
        let high = self.num_pages as i64 + 1;
        for (i, &(first, count)) in runs.iter().enumerate() {
            let end = i64::from(first) + i64::from(count);
            let err = if count == 0 {
                None
            } else if first == 0 || end > high {
                Some(CoreError::OutOfRange {
                    what: "kv page",
                    value: if first == 0 {
                        0
                    } else {
                        i64::from(first).max(high)
                    },
                    low: 1,
                    high,
                })
            } else {
                // Marked as we go, so a page repeated by a later run is caught too.
                self.mark_free_range(first, end as u32)
                    .err()
                    .map(|p| CoreError::DoubleFree(self.first_slot(p)))
            };
            if let Some(e) = err {
                for &(f, c) in &runs[..i] {
                    self.mark_used(f, f + c);
                }
                return Err(e);
            }
        }
        for &(first, count) in runs.iter().filter(|r| r.1 > 0) {
            self.num_free += count as usize;
            match self.free_runs.back_mut() {
                Some(back) if back.0 + back.1 == first => back.1 += count,
                _ => self.free_runs.push_back((first, count)),
            }
        }
        Ok(())
    }

    /// Marks pages `lo..hi` (in range, `lo < hi`) free, a bitset word at a time. Errors with
    /// the first page of the range that is already free, with nothing changed.
    fn mark_free_range(&mut self, lo: u32, hi: u32) -> Result<(), u32> {
        let words = lo as usize / 64..=(hi as usize - 1) / 64;
        for w in words.clone() {
            let taken = self.page_free[w] & word_mask(lo, hi, w);
            if taken != 0 {
                return Err((w * 64) as u32 + taken.trailing_zeros());
            }
        }
        for w in words {
            self.page_free[w] |= word_mask(lo, hi, w);
        }
        Ok(())
    }

    /// Marks pages `lo..hi` in use (they were free), a bitset word at a time.
    fn mark_used(&mut self, lo: u32, hi: u32) {
        if lo >= hi {
            return;
        }
        for w in lo as usize / 64..=(hi as usize - 1) / 64 {
            self.page_free[w] &= !word_mask(lo, hi, w);
        }
    }

    /// The distinct pages of `slots`, checked as [`Self::free`] describes (without the
    /// already-free check).
    pub fn pages_of_runs(&self, slots: &[i64]) -> CoreResult<Vec<u32>> {
        let (ps, high) = (
            self.page_size as i64,
            (self.num_pages as i64 + 1) * self.page_size as i64,
        );
        let mut pages: Vec<u32> = Vec::with_capacity(slots.len() / self.page_size + 1);
        // `prev` is the previous slot and the end of its page: a slot in `(prev, end)` is
        // the same page, anything else starts a new run.
        let (mut prev, mut end) = (i64::MIN, i64::MIN);
        for &s in slots {
            if s < ps || s >= high {
                return Err(CoreError::OutOfRange {
                    what: "kv slot",
                    value: s,
                    low: ps,
                    high,
                });
            }
            if s > prev && s < end {
                prev = s;
                continue;
            }
            if s < end && s >= end - ps {
                return Err(CoreError::DoubleFree(s)); // same page, not increasing
            }
            let page = self.page_of(s);
            pages.push(page);
            prev = s;
            end = (page as i64 + 1) * ps;
        }
        Ok(pages)
    }

    /// Frees whole pages. Errors, with nothing freed: [`CoreError::OutOfRange`] for page 0 or
    /// a page past the end, [`CoreError::DoubleFree`] for a free or repeated page (reported
    /// as its first slot).
    pub fn free_pages_checked(&mut self, pages: &[u32]) -> CoreResult<()> {
        let mut runs = SlotRuns::new();
        for &p in pages {
            runs.push(p);
        }
        self.free_page_runs(runs.runs())
    }

    /// Number of free slots (tokens): free pages times `page_size`.
    pub fn available_size(&self) -> usize {
        self.num_free * self.page_size
    }

    /// Number of free pages.
    pub fn available_pages(&self) -> usize {
        self.num_free
    }

    /// Number of allocatable slots (tokens), excluding the reserved page 0.
    pub fn size(&self) -> usize {
        self.num_pages * self.page_size
    }

    /// Number of allocatable pages.
    pub fn num_pages(&self) -> usize {
        self.num_pages
    }

    /// Rows the KV tensors need: every slot of pages `0..=num_pages` (`size + page_size`).
    pub fn num_slot_rows(&self) -> usize {
        (self.num_pages + 1) * self.page_size
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Whether the page holding `slot` is free (`false` for page 0 and out-of-range slots).
    pub fn is_free(&self, slot: i64) -> bool {
        slot >= 0 && self.is_page_free(self.page_of(slot))
    }

    /// Whether page `page` is free.
    #[inline]
    pub fn is_page_free(&self, page: u32) -> bool {
        page as usize <= self.num_pages
            && self.page_free[page as usize / 64] & (1 << (page % 64)) != 0
    }

    /// The free pages in hand-out order (for integrity checks).
    pub fn free_page_list(&self) -> impl Iterator<Item = u32> + '_ {
        self.free_runs
            .iter()
            .flat_map(|&(first, count)| first..first + count)
    }
}

/// The bits of bitset word `w` that pages `lo..hi` cover (the range must touch word `w`).
#[inline]
fn word_mask(lo: u32, hi: u32, w: usize) -> u64 {
    let (a, b) = ((lo as usize).max(w * 64), (hi as usize).min(w * 64 + 64));
    (u64::MAX >> (64 - (b - a))) << (a - w * 64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_hands_out_in_order_and_never_slot_zero() {
        let mut a = TokenToKVPoolAllocator::new(5, 1).unwrap();
        assert_eq!((a.size(), a.page_size(), a.num_slot_rows()), (5, 1, 6));
        assert_eq!(a.alloc(2), Some(vec![1, 2]));
        assert_eq!(a.alloc(4), None);
        assert_eq!(a.available_size(), 3);
        assert_eq!(a.alloc(3), Some(vec![3, 4, 5]));
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.alloc(0), Some(vec![]));
    }

    #[test]
    fn pages_cover_aligned_slots() {
        let mut a = TokenToKVPoolAllocator::new(12, 4).unwrap();
        assert_eq!((a.num_pages(), a.num_slot_rows()), (3, 16));
        assert_eq!(a.alloc(5), Some(vec![4, 5, 6, 7, 8]));
        assert_eq!(a.available_size(), 4);
        assert!(!a.is_free(9) && a.is_free(12) && !a.is_free(0));
        a.free(&[8]).unwrap(); // one slot frees its whole page
        assert_eq!(a.alloc(8), Some(vec![12, 13, 14, 15, 8, 9, 10, 11]));
        assert!(TokenToKVPoolAllocator::new(10, 4).is_err());
        assert!(TokenToKVPoolAllocator::new(10, 0).is_err());
    }

    #[test]
    fn free_bits_across_words() {
        // Pages 63, 64 and 127, 128 straddle words of the free bitset.
        let mut a = TokenToKVPoolAllocator::new(130, 1).unwrap();
        a.alloc(130).unwrap();
        a.free(&[64, 63, 128]).unwrap();
        assert!(a.is_free(63) && a.is_free(64) && a.is_free(128));
        assert!(!a.is_free(62) && !a.is_free(65) && !a.is_free(127) && !a.is_free(130));
        assert!(!a.is_free(131) && !a.is_page_free(200) && !a.is_free(0));
        assert_eq!(a.free(&[127, 128]), Err(CoreError::DoubleFree(128)));
        assert!(!a.is_free(127)); // rolled back
        assert_eq!(a.alloc(3), Some(vec![64, 63, 128]));
    }

    #[test]
    fn free_marks_runs_across_words_and_rolls_back() {
        let mut a = TokenToKVPoolAllocator::new(300, 1).unwrap();
        a.alloc(300).unwrap();
        // A run over words 0-3, then a run repeating slot 150: error, nothing freed.
        let mut slots: Vec<i64> = (10..200).collect();
        slots.extend([150, 151]);
        assert_eq!(a.free(&slots), Err(CoreError::DoubleFree(150)));
        assert_eq!(a.available_size(), 0);
        assert!((1..=300).all(|s| !a.is_free(s)));
        // A run running past the pool is refused at its first slot out of range.
        assert!(matches!(
            a.free(&[299_i64, 300, 301]),
            Err(CoreError::OutOfRange { value: 301, .. })
        ));
        assert!(!a.is_free(299));
        // u32 slots (as the radix cache stores them) free the same way.
        a.free(&[64_u32, 65, 66, 3, 128, 127]).unwrap();
        assert!([3, 64, 65, 66, 127, 128].iter().all(|&s| a.is_free(s)));
        assert!(!a.is_free(63) && !a.is_free(67) && !a.is_free(126) && !a.is_free(129));
        assert_eq!(a.alloc(6), Some(vec![64, 65, 66, 3, 128, 127]));
    }

    #[test]
    fn slots_must_fit_in_i32() {
        // (Only the refusals: an accepted pool this size would allocate 16 GiB of free list.)
        assert!(TokenToKVPoolAllocator::new(i32::MAX as usize, 1).is_err());
        assert!(TokenToKVPoolAllocator::new(i32::MAX as usize - 15, 16).is_err());
    }

    #[test]
    fn free_reuses_fifo() {
        let mut a = TokenToKVPoolAllocator::new(4, 1).unwrap();
        let x = a.alloc(3).unwrap();
        a.free(&[x[1], x[0]]).unwrap();
        assert_eq!(a.available_size(), 3);
        assert_eq!(a.alloc(3), Some(vec![4, 2, 1]));
    }

    #[test]
    fn free_errors_change_nothing() {
        let mut a = TokenToKVPoolAllocator::new(4, 1).unwrap();
        a.alloc(3).unwrap();
        assert_eq!(a.free(&[1, 4]), Err(CoreError::DoubleFree(4)));
        assert_eq!(a.free(&[1, 1]), Err(CoreError::DoubleFree(1)));
        assert!(matches!(
            a.free(&[2, 0]),
            Err(CoreError::OutOfRange { value: 0, .. })
        ));
        assert!(matches!(
            a.free(&[5]),
            Err(CoreError::OutOfRange { value: 5, .. })
        ));
        assert_eq!(a.available_size(), 1);
        assert!(!a.is_free(1) && !a.is_free(2) && a.is_free(4));
        a.free(&[1, 2, 3]).unwrap();
        assert_eq!(a.free(&[2]), Err(CoreError::DoubleFree(2)));
        assert_eq!(a.available_size(), 4);
        let mut b = TokenToKVPoolAllocator::new(8, 4).unwrap();
        b.alloc(8).unwrap();
        assert_eq!(b.free(&[4, 5, 8, 6]), Err(CoreError::DoubleFree(4)));
        assert_eq!(b.free(&[5, 5]), Err(CoreError::DoubleFree(5)));
        assert!(matches!(
            b.free(&[3]),
            Err(CoreError::OutOfRange { value: 3, .. })
        ));
        assert_eq!(b.available_size(), 0);
    }
}
