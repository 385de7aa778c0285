//! The KV slot allocator: hands out indices into the KV cache tensors.
//!
//! A KV slot holds the keys and values of one token in every layer. Slots are numbered
//! `1..=size`; slot 0 is the padding slot (padded batch entries write there) and is never
//! handed out. Allocation is first-in first-out over the free list: a fresh allocator hands out
//! `1, 2, 3, ...` and freed slots are reused after every slot freed before them, which makes
//! slot reuse exact and testable.

use std::collections::VecDeque;

use crate::error::{CoreError, CoreResult};

/// Allocator of KV slots `1..=size` (slot 0 is reserved for padding).
///
/// `page_size` is kept for the paged variant; it is always 1 for now, so one slot is one token.
#[derive(Debug, Clone)]
pub struct TokenToKVPoolAllocator {
    size: usize,
    page_size: usize,
    /// Free slots in hand-out order (front first).
    free_slots: VecDeque<i64>,
    /// `is_free[s]` for every slot `0..=size`; index 0 (padding) is always `false`.
    is_free: Vec<bool>,
}

impl TokenToKVPoolAllocator {
    /// Creates an allocator owning slots `1..=size`, all free. Units: slots (= tokens).
    pub fn new(size: usize) -> Self {
        let mut is_free = vec![true; size + 1];
        is_free[0] = false;
        Self {
            size,
            page_size: 1,
            free_slots: (1..=size as i64).collect(),
            is_free,
        }
    }

    /// Takes `n` free slots, oldest-freed first. Returns `None`, and changes nothing, when fewer
    /// than `n` are free; never a partial allocation. `alloc(0)` returns an empty vector.
    pub fn alloc(&mut self, n: usize) -> Option<Vec<i64>> {
        if n > self.free_slots.len() {
            return None;
        }
        let out: Vec<i64> = self.free_slots.drain(..n).collect();
        for &s in &out {
            self.is_free[s as usize] = false;
        }
        Some(out)
    }

    /// Returns `slots` to the free list (appended in the given order).
    ///
    /// Errors, with nothing freed: [`CoreError::OutOfRange`] if a slot is not in `1..=size`
    /// (slot 0 included), [`CoreError::DoubleFree`] if a slot is already free or appears twice
    /// in `slots`.
    pub fn free(&mut self, slots: &[i64]) -> CoreResult<()> {
        // Mark as we check so duplicates inside `slots` are caught; roll back on error.
        for (i, &s) in slots.iter().enumerate() {
            let err = if s < 1 || s > self.size as i64 {
                Some(CoreError::OutOfRange {
                    what: "kv slot",
                    value: s,
                    low: 1,
                    high: self.size as i64 + 1,
                })
            } else if self.is_free[s as usize] {
                Some(CoreError::DoubleFree(s))
            } else {
                None
            };
            if let Some(e) = err {
                for &t in &slots[..i] {
                    self.is_free[t as usize] = false;
                }
                return Err(e);
            }
            self.is_free[s as usize] = true;
        }
        self.free_slots.extend(slots.iter().copied());
        Ok(())
    }

    /// Number of free slots (tokens).
    pub fn available_size(&self) -> usize {
        self.free_slots.len()
    }

    /// Number of allocatable slots, excluding the padding slot 0.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Tokens per page; always 1 in this version.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Whether `slot` is currently free (`false` for slot 0 and out-of-range slots).
    pub fn is_free(&self, slot: i64) -> bool {
        slot >= 0 && (slot as usize) < self.is_free.len() && self.is_free[slot as usize]
    }

    /// Frees every slot: the allocator returns to its freshly created state.
    pub fn clear(&mut self) {
        *self = Self::new(self.size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_hands_out_in_order_and_never_slot_zero() {
        let mut a = TokenToKVPoolAllocator::new(5);
        assert_eq!(a.size(), 5);
        assert_eq!(a.page_size(), 1);
        assert_eq!(a.alloc(2), Some(vec![1, 2]));
        assert_eq!(a.alloc(4), None);
        assert_eq!(a.available_size(), 3);
        assert_eq!(a.alloc(3), Some(vec![3, 4, 5]));
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.alloc(0), Some(vec![]));
    }

    #[test]
    fn free_reuses_fifo() {
        let mut a = TokenToKVPoolAllocator::new(4);
        let x = a.alloc(3).unwrap();
        a.free(&[x[1], x[0]]).unwrap();
        assert_eq!(a.available_size(), 3);
        assert_eq!(a.alloc(3), Some(vec![4, 2, 1]));
    }

    #[test]
    fn free_errors_change_nothing() {
        let mut a = TokenToKVPoolAllocator::new(4);
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
    }
}
