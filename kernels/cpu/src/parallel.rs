//! Spreading a kernel's work over threads: on the OpenMP team torch itself runs on, when
//! `use_openmp` was given libgomp's entry points, else on scoped threads of our own.
//!
//! Why torch's team: between torch ops libgomp's idle team threads keep spinning for a while
//! (GOMP_SPINCOUNT), so a thread of our own started right after a torch op shares its core with
//! a spinning one; on the 2-core test machine that made the decode-attention kernel 1.5-3x
//! slower than alone. Work handed to the spinning team starts at once, on no extra thread.
//! This is what a C++ kernel gets from `at::parallel_for` (as SGLang's and IPEX's CPU kernels
//! use); from Rust we call libgomp's `GOMP_parallel` ourselves.

use std::ffi::{c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Below this many floats per thread, extra threads cost more than they save.
pub const MIN_FLOATS_PER_THREAD: usize = 1 << 16;

/// How many threads (at most `num_threads`, at least 1) to use for `work` floats.
pub fn threads_for(work: usize, num_threads: usize) -> usize {
    num_threads.max(1).min(work / MIN_FLOATS_PER_THREAD + 1)
}

type GompParallel =
    unsafe extern "C" fn(unsafe extern "C" fn(*mut c_void), *mut c_void, c_uint, c_uint);

#[derive(Clone, Copy)]
struct OpenMp {
    parallel: GompParallel,
}

static OPENMP: OnceLock<OpenMp> = OnceLock::new();

/// Makes every later parallel kernel run on the calling thread's OpenMP team through libgomp's
/// `GOMP_parallel`. Returns false (and changes nothing) if it was already set.
///
/// # Safety
/// The address must be `GOMP_parallel` of the libgomp loaded in this process.
pub unsafe fn use_openmp(parallel: usize) -> bool {
    let omp = OpenMp {
        parallel: std::mem::transmute::<usize, GompParallel>(parallel),
    };
    OPENMP.set(omp).is_ok()
}

/// Whether kernels run on the OpenMP team (see `use_openmp`).
pub fn uses_openmp() -> bool {
    OPENMP.get().is_some()
}

struct Job<'a> {
    num_tasks: usize,
    /// The next task not yet claimed.
    next: AtomicUsize,
    task: &'a (dyn Fn(usize) + Sync),
    panicked: AtomicBool,
}

unsafe extern "C" fn run_job(data: *mut c_void) {
    // SAFETY: `data` is the `Job` that `run_tasks` keeps alive until GOMP_parallel returns.
    let job = &*(data as *const Job<'_>);
    // A panic must not unwind into C; it is re-raised on the calling thread.
    let result = catch_unwind(AssertUnwindSafe(|| {
        claim_tasks(&job.next, job.num_tasks, job.task)
    }));
    if result.is_err() {
        job.panicked.store(true, Ordering::Relaxed);
    }
}

/// Runs tasks in claim order until none is left: each thread takes the next unclaimed one.
fn claim_tasks(next: &AtomicUsize, num_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= num_tasks {
            return;
        }
        task(i);
    }
}

/// Calls `task(i)` once for each i in 0..num_tasks, on up to num_tasks threads (the calling
/// thread among them), and returns when all are done.
pub fn run_tasks(num_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    run_tasks_on(num_tasks, num_tasks, task)
}

/// Calls `task(i)` once for each i in 0..num_tasks on up to `num_threads` threads (the
/// calling thread among them), each thread claiming the next task when it finishes one, and
/// returns when all are done.
///
/// Why claimed, not dealt out in advance: on a machine whose cores are shared (the event loop
/// and the HTTP client run beside the model on the 2-core test machine), a thread descheduled
/// for a while would hold up the whole call with its share; cut into several tasks per thread,
/// the running threads take over its remaining ones.
pub fn run_tasks_on(num_tasks: usize, num_threads: usize, task: &(dyn Fn(usize) + Sync)) {
    let num_threads = num_threads.clamp(1, num_tasks.max(1));
    match num_tasks {
        0 => return,
        1 => return task(0),
        _ => {}
    }
    if num_threads == 1 {
        return (0..num_tasks).for_each(task);
    }
    if let Some(&omp) = OPENMP.get() {
        let job = Job {
            num_tasks,
            next: AtomicUsize::new(0),
            task,
            panicked: AtomicBool::new(false),
        };
        // SAFETY: entry points from `use_openmp`'s contract; `job` outlives the call.
        unsafe {
            (omp.parallel)(
                run_job,
                &job as *const Job<'_> as *mut c_void,
                num_threads as c_uint,
                0,
            )
        };
        assert!(
            !job.panicked.load(Ordering::Relaxed),
            "a kernel task panicked"
        );
        return;
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 1..num_threads {
            scope.spawn(|| claim_tasks(&next, num_tasks, task));
        }
        claim_tasks(&next, num_tasks, task);
    });
}

/// Cuts consecutive units of work, of the given `weights` summing to `total`, into at most
/// `parts` contiguous ranges of about total / parts each. Returns the range bounds: rising
/// from 0 to the number of units, no range empty.
pub fn balanced_bounds(
    weights: impl IntoIterator<Item = usize>,
    total: usize,
    parts: usize,
) -> Vec<usize> {
    let mut bounds = vec![0usize];
    let mut acc = 0usize;
    let mut count = 0usize;
    for (u, w) in weights.into_iter().enumerate() {
        acc += w;
        count = u + 1;
        if acc * parts >= total * bounds.len() && bounds.len() < parts {
            bounds.push(u + 1);
        }
    }
    bounds.push(count);
    bounds.dedup();
    bounds
}

/// Calls `f(first_row, rows)` on consecutive chunks of `out`'s rows (`row_len` floats each),
/// one chunk per thread (at most `threads`), all done before returning.
pub fn for_row_chunks<F>(out: &mut [f32], row_len: usize, threads: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    for_row_chunks2(out, &mut [], row_len, 0, threads, |first, a, _| f(first, a));
}

/// As `for_row_chunks` over two arrays split at the same rows: `a` has `a_row_len` floats per
/// row, `b` has `b_row_len` (0: `b` is ignored and may be empty).
pub fn for_row_chunks2<F>(
    a: &mut [f32],
    b: &mut [f32],
    a_row_len: usize,
    b_row_len: usize,
    threads: usize,
    f: F,
) where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync,
{
    let rows = a.len().checked_div(a_row_len).unwrap_or(0);
    let threads = threads.clamp(1, rows.max(1));
    if threads == 1 {
        return f(0, a, b);
    }
    let per = rows.div_ceil(threads);
    let mut chunks = Vec::with_capacity(threads);
    let (mut a_rest, mut b_rest) = (a, b);
    let mut first_row = 0;
    while first_row < rows {
        let n = per.min(rows - first_row);
        let (a_chunk, a_tail) = std::mem::take(&mut a_rest).split_at_mut(n * a_row_len);
        let (b_chunk, b_tail) = std::mem::take(&mut b_rest).split_at_mut(n * b_row_len);
        (a_rest, b_rest) = (a_tail, b_tail);
        chunks.push(Mutex::new((first_row, a_chunk, b_chunk)));
        first_row += n;
    }
    run_tasks(chunks.len(), &|i| {
        let mut chunk = chunks[i].lock().unwrap();
        let (first, ref mut a, ref mut b) = *chunk;
        f(first, a, b);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_visited_once_with_its_index() {
        for threads in 1..5 {
            let mut out = vec![0f32; 7 * 3];
            for_row_chunks(&mut out, 3, threads, |first, chunk| {
                for (i, row) in chunk.chunks_mut(3).enumerate() {
                    for x in row {
                        *x += (first + i) as f32;
                    }
                }
            });
            let want: Vec<f32> = (0..7).flat_map(|r| [r as f32; 3]).collect();
            assert_eq!(out, want, "threads {threads}");
        }
    }

    #[test]
    fn small_work_stays_on_one_thread() {
        assert_eq!(threads_for(1000, 8), 1);
        assert_eq!(threads_for(3 * MIN_FLOATS_PER_THREAD, 2), 2);
        assert_eq!(threads_for(3 * MIN_FLOATS_PER_THREAD, 0), 1);
    }

    #[test]
    fn balanced_bounds_cut_by_weight_into_nonempty_ranges() {
        assert_eq!(balanced_bounds([1, 1, 1, 1], 4, 2), vec![0, 2, 4]);
        assert_eq!(balanced_bounds([9, 1, 1, 1], 12, 2), vec![0, 1, 4]);
        assert_eq!(balanced_bounds([5], 5, 4), vec![0, 1]);
        assert_eq!(balanced_bounds([], 0, 3), vec![0]);
    }

    #[test]
    fn run_tasks_runs_each_task_once() {
        let hits: Vec<Mutex<u32>> = (0..5).map(|_| Mutex::new(0)).collect();
        run_tasks(5, &|i| *hits[i].lock().unwrap() += 1);
        assert!(hits.iter().all(|h| *h.lock().unwrap() == 1));
    }
}
