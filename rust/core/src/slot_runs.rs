//! `SlotRuns`: a list of KV slots stored as runs of consecutive slots.
//!
//! The allocator hands out consecutive pages as long as its free list allows, so a prefill's
//! slots are a few long runs: a 2,000-token prompt on a fresh pool is one run `(first, 2000)`.
//! Storing runs instead of one entry per token makes what the radix cache does per cached node
//! (keep its slots, give them back on eviction, hand them to a request that matches them)
//! cost per run instead of per token. Decode slots of concurrent requests interleave, so a
//! request's decoded tokens are runs of length 1: 8 bytes per token, as plain `i64` slots.

use smallvec::SmallVec;

/// KV slots in order, as `(first slot, length)` runs of consecutive slots; adjacent runs
/// never continue each other (they are merged). Up to two runs are stored inline, without a
/// heap buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotRuns {
    runs: SmallVec<[(u32, u32); 2]>,
    len: usize,
}

impl SlotRuns {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// The runs of `slots` (each must fit in `u32`: the allocator guarantees it).
    pub fn from_slots<S: Copy + Into<i64>>(slots: &[S]) -> Self {
        let mut out = Self::new();
        for &s in slots {
            out.push(s.into() as u32);
        }
        out
    }

    /// Appends one slot, extending the last run when it continues it.
    #[inline]
    pub fn push(&mut self, slot: u32) {
        self.push_run(slot, 1);
    }

    /// Appends `len` consecutive slots from `first` (nothing if `len == 0`).
    #[inline]
    pub fn push_run(&mut self, first: u32, len: u32) {
        if len == 0 {
            return;
        }
        self.len += len as usize;
        if let Some(last) = self.runs.last_mut() {
            if last.0.wrapping_add(last.1) == first {
                last.1 += len;
                return;
            }
        }
        self.runs.push((first, len));
    }

    /// Appends all of `other`.
    pub fn append(&mut self, other: &SlotRuns) {
        for &(first, len) in &other.runs {
            self.push_run(first, len);
        }
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no slots.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `(first slot, length)` runs, in order.
    pub fn runs(&self) -> &[(u32, u32)] {
        &self.runs
    }

    /// The first slot, if any.
    pub fn first(&self) -> Option<u32> {
        self.runs.first().map(|r| r.0)
    }

    /// Every slot in order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.runs
            .iter()
            .flat_map(|&(first, len)| first..first + len)
    }

    /// Appends every slot, as `i64`, to `out`.
    pub fn extend_into(&self, out: &mut Vec<i64>) {
        out.reserve(self.len);
        for &(first, len) in &self.runs {
            out.extend(i64::from(first)..i64::from(first) + i64::from(len));
        }
    }

    /// Whether the representation is canonical: no empty run, no run continuing the one
    /// before it, `len` the sum of the run lengths (for integrity checks).
    pub fn is_well_formed(&self) -> bool {
        let sum: usize = self.runs.iter().map(|r| r.1 as usize).sum();
        sum == self.len
            && self.runs.iter().all(|r| r.1 > 0)
            && self
                .runs
                .windows(2)
                .all(|w| w[0].0.wrapping_add(w[0].1) != w[1].0)
    }

    /// Removes the first `at` slots and returns them (`at` is clamped to `len`).
    pub fn split_front(&mut self, at: usize) -> SlotRuns {
        let at = at.min(self.len);
        let mut front = SlotRuns {
            runs: SmallVec::new(),
            len: at,
        };
        let (mut whole, mut need) = (0, at);
        for &(first, len) in &self.runs {
            if need == 0 {
                break;
            }
            if len as usize <= need {
                front.runs.push((first, len));
                need -= len as usize;
                whole += 1;
            } else {
                front.runs.push((first, need as u32));
                break; // `need` slots of this run stay to be cut below
            }
        }
        self.runs.drain(..whole);
        if need > 0 {
            let r = &mut self.runs[0];
            r.0 += need as u32;
            r.1 -= need as u32;
        }
        self.len -= at;
        front
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_and_split() {
        let mut r = SlotRuns::from_slots(&[5_i64, 6, 7, 9, 10, 3]);
        assert_eq!(r.runs(), &[(5, 3), (9, 2), (3, 1)]);
        assert_eq!((r.len(), r.first()), (6, Some(5)));
        r.push_run(4, 2);
        r.push(8);
        assert_eq!(r.runs(), &[(5, 3), (9, 2), (3, 3), (8, 1)]);
        let front = r.split_front(4);
        assert_eq!(front.runs(), &[(5, 3), (9, 1)]);
        assert_eq!(r.runs(), &[(10, 1), (3, 3), (8, 1)]);
        assert_eq!((front.len(), r.len()), (4, 5));
        let mut out = vec![1];
        r.extend_into(&mut out);
        assert_eq!(out, vec![1, 10, 3, 4, 5, 8]);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![10, 3, 4, 5, 8]);
        assert_eq!(r.split_front(0), SlotRuns::new());
        let all = r.split_front(99);
        assert_eq!((all.len(), r.len(), r.runs().len()), (5, 0, 0));
        let mut a = SlotRuns::from_slots(&[1_u32, 2]);
        a.append(&SlotRuns::from_slots(&[3_u32, 7]));
        assert_eq!(a.runs(), &[(1, 3), (7, 1)]);
    }
}
