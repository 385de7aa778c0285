//! Request rows: for each running request, the KV slot of every token position.
//!
//! The pool is a `size x max_context_len` table of KV slots, stored as `i32` (the allocator
//! keeps every slot below 2^31; SGLang's `req_to_token` is int32 too). A request owns one row
//! (`req_pool_idx`) from admission until it finishes or aborts; column `p` of its row is the
//! KV slot of the token at position `p`.

use std::collections::VecDeque;

use crate::error::{CoreError, CoreResult};

/// A table of `size` request rows, each `max_context_len` KV slots wide.
#[derive(Debug, Clone)]
pub struct ReqToTokenPool {
    size: usize,
    max_context_len: usize,
    /// Row-major `[size, max_context_len]` KV slots; unwritten cells hold 0 (the padding slot).
    table: Vec<i32>,
    free_rows: VecDeque<usize>,
    in_use: Vec<bool>,
}

impl ReqToTokenPool {
    /// Creates `size` free rows of `max_context_len` slots, filled with 0.
    ///
    /// Errors: [`CoreError::ShapeMismatch`] if the table holds more than `i32::MAX` cells or
    /// its memory cannot be reserved (rather than aborting the process). The bound keeps
    /// every row index, position, row-table offset (`row * max_context_len + position`) and
    /// batch total of row lengths (distinct rows) in `i32`, the dtype of every index array
    /// of a batch (`BatchArrays`) and of the worker's device tables.
    pub fn new(size: usize, max_context_len: usize) -> CoreResult<Self> {
        let cells = size
            .checked_mul(max_context_len)
            .filter(|&n| n <= i32::MAX as usize);
        let mut table = Vec::new();
        if cells.is_none_or(|n| table.try_reserve_exact(n).is_err()) {
            return Err(CoreError::ShapeMismatch(format!(
                "a request table of {size} rows x {max_context_len} tokens cannot be allocated \
                 (at most {} cells, its memory free)",
                i32::MAX
            )));
        }
        table.resize(size * max_context_len, 0);
        Ok(Self {
            size,
            max_context_len,
            table,
            free_rows: (0..size).collect(),
            in_use: vec![false; size],
        })
    }

    /// Takes a free row, lowest-freed-first (FIFO). `None` if every row is in use.
    pub fn alloc(&mut self) -> Option<usize> {
        let idx = self.free_rows.pop_front()?;
        self.in_use[idx] = true;
        Some(idx)
    }

    /// Returns row `idx` to the pool. The row's contents are left as they are.
    ///
    /// Errors: [`CoreError::UnknownReqSlot`] if `idx >= size`, [`CoreError::DoubleFree`] if
    /// the row is already free.
    pub fn free(&mut self, idx: usize) -> CoreResult<()> {
        if idx >= self.size {
            return Err(CoreError::UnknownReqSlot(idx));
        }
        if !self.in_use[idx] {
            return Err(CoreError::DoubleFree(idx as i64));
        }
        self.in_use[idx] = false;
        self.free_rows.push_back(idx);
        Ok(())
    }

    /// Writes `slots` (each below 2^31) into row `idx` at columns
    /// `[start, start + slots.len())`.
    ///
    /// Errors: [`CoreError::UnknownReqSlot`] if the row is not allocated,
    /// [`CoreError::OutOfRange`] if the columns run past `max_context_len`.
    pub fn write<S: Copy + Into<i64>>(
        &mut self,
        idx: usize,
        start: usize,
        slots: &[S],
    ) -> CoreResult<()> {
        self.check_span(idx, start, start + slots.len())?;
        let base = idx * self.max_context_len + start;
        for (cell, &s) in self.table[base..base + slots.len()].iter_mut().zip(slots) {
            *cell = s.into() as i32; // slots stay below 2^31 (the allocator's bound)
        }
        Ok(())
    }

    /// Reads columns `[start, end)` of row `idx`.
    ///
    /// Errors: [`CoreError::UnknownReqSlot`] if the row is not allocated,
    /// [`CoreError::OutOfRange`] if `start > end` or `end > max_context_len`.
    pub fn read(&self, idx: usize, start: usize, end: usize) -> CoreResult<&[i32]> {
        self.check_span(idx, start, end)?;
        let base = idx * self.max_context_len;
        Ok(&self.table[base + start..base + end])
    }

    /// Checks that row `idx` is allocated and `[start, end)` is a valid column span.
    pub fn check_span(&self, idx: usize, start: usize, end: usize) -> CoreResult<()> {
        self.check_row(idx)?;
        if start > end || end > self.max_context_len {
            return Err(CoreError::OutOfRange {
                what: "req_to_token column",
                value: end.max(start) as i64,
                low: start.min(end) as i64,
                high: self.max_context_len as i64 + 1,
            });
        }
        Ok(())
    }

    /// Checks that row `idx` exists and is allocated ([`CoreError::UnknownReqSlot`] if not).
    pub fn check_row(&self, idx: usize) -> CoreResult<()> {
        if idx >= self.size || !self.in_use[idx] {
            return Err(CoreError::UnknownReqSlot(idx));
        }
        Ok(())
    }

    /// Number of free rows.
    pub fn available_size(&self) -> usize {
        self.free_rows.len()
    }

    /// Total number of rows.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Columns per row: the longest sequence (prompt + output tokens) a request may reach.
    pub fn max_context_len(&self) -> usize {
        self.max_context_len
    }

    /// Frees every row (contents are left as they are).
    pub fn clear(&mut self) {
        self.free_rows = (0..self.size).collect();
        self.in_use.iter_mut().for_each(|u| *u = false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_free_rows() {
        let mut p = ReqToTokenPool::new(2, 8).unwrap();
        assert_eq!((p.size(), p.max_context_len()), (2, 8));
        assert_eq!(p.alloc(), Some(0));
        assert_eq!(p.alloc(), Some(1));
        assert_eq!(p.alloc(), None);
        p.free(0).unwrap();
        assert_eq!(p.free(0), Err(CoreError::DoubleFree(0)));
        assert_eq!(p.free(2), Err(CoreError::UnknownReqSlot(2)));
        assert_eq!(p.available_size(), 1);
        assert_eq!(p.alloc(), Some(0));
    }

    #[test]
    fn impossible_tables_are_refused() {
        assert!(ReqToTokenPool::new(2, usize::MAX).is_err());
        assert!(ReqToTokenPool::new(1 << 40, 1 << 20).is_err());
        assert!(ReqToTokenPool::new(1 << 11, 1 << 20).is_err()); // 2^31 cells: past i32
    }

    #[test]
    fn write_read_bounds() {
        let mut p = ReqToTokenPool::new(2, 4).unwrap();
        let r = p.alloc().unwrap();
        p.write(r, 1, &[7, 8, 9]).unwrap();
        assert_eq!(p.read(r, 0, 4).unwrap(), &[0, 7, 8, 9]);
        assert!(matches!(
            p.write(r, 2, &[1, 2, 3]),
            Err(CoreError::OutOfRange { .. })
        ));
        assert!(matches!(p.read(r, 3, 2), Err(CoreError::OutOfRange { .. })));
        assert_eq!(p.read(1, 0, 1), Err(CoreError::UnknownReqSlot(1)));
        assert_eq!(p.write(1, 0, &[1]), Err(CoreError::UnknownReqSlot(1)));
        assert_eq!(p.read(r, 2, 2).unwrap(), &[] as &[i32]);
    }
}
