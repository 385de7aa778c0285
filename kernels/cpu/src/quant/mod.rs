//! Matrix products with GGUF block-quantized weights, kept quantized (llama.cpp's block formats,
//! ggml `ggml-common.h`): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and the K-quants
//! Q4_K, Q5_K, Q6_K (super-blocks of 256).
//!
//! The activations are quantized per block of 32 to int8 with one float32 scale
//! (`d = max|x| / 127`, `q = round_ties_even(x * (1 / d))`), so each block's dot product is an
//! exact integer sum of int8 x int8 products; the weight scales, and the weight mins times the
//! activation block sums, are applied in float32. This is the scheme of llama.cpp's `vec_dot`
//! kernels (Q8_0 / Q8_1 activations), with one simplification: one activation format (per-32
//! scale) pairs with every weight type, the K-quants included (llama.cpp's Q8_K has one scale per
//! 256). Activation rounding bounds the error: per block of 32, `|Δy| <= d / 2 * Σ|w_i|`, so
//! `|y - y_f32| <= Σ_blocks (max_i |x_i| / 254) * Σ_i |w_i|`, plus float32 rounding.
//!
//! Every instruction-set path computes the same arithmetic in the same order, so their results
//! are bit-identical (tested): each block gives eight int32 lane sums of four consecutive
//! products (what AVX2's `maddubs`+`madd` and AVX-512 VNNI's `dpbusd` produce), each lane is
//! accumulated with one fused multiply-add `acc[l] = fma(w_scale[l] * d_x, lane, acc[l])`, the
//! min terms in one scalar `fma(w_min, x_sum, acc)` per block, and the eight lanes are reduced in
//! a fixed tree. See `blocks` for the formats, `x86` for the SIMD paths.

mod activations;
mod block32;
#[cfg(target_arch = "x86_64")]
mod block32_x86;
mod blocks;
pub mod interleave;
#[cfg(target_arch = "x86_64")]
mod x86;

pub(crate) use activations::ActRow;
pub use activations::QuantActivations;
#[cfg(test)]
use activations::{quantize_blocks, quantize_blocks_portable};
pub use blocks::{f16_to_f32, QuantType};

use crate::parallel;

/// The instruction sets a kernel can run with, best last.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Portable Rust (any CPU).
    Scalar,
    /// AVX2 + FMA + F16C: `maddubs` / `madd` integer dots.
    Avx2,
    /// AVX-512 VNNI's `dpbusd`, on 256-bit vectors and, for tiles of 16 activation rows, on
    /// 512-bit ones (needs avx512f, avx512bw, avx512vl and avx512vnni).
    Avx512Vnni,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512Vnni => "avx512vnni",
        }
    }

    pub fn from_name(name: &str) -> Option<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni]
            .into_iter()
            .find(|isa| isa.name() == name)
    }
}

/// The instruction sets this CPU can run, `Scalar` first, the best last (detected once).
pub fn available_isas() -> &'static [Isa] {
    static ISAS: std::sync::OnceLock<Vec<Isa>> = std::sync::OnceLock::new();
    ISAS.get_or_init(detect_isas)
}

fn detect_isas() -> Vec<Isa> {
    let mut isas = vec![Isa::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
        {
            isas.push(Isa::Avx2);
            if std::is_x86_feature_detected!("avx512vnni")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512bw")
            {
                isas.push(Isa::Avx512Vnni);
            }
        }
    }
    isas
}

/// The best instruction set of this CPU.
pub fn best_isa() -> Isa {
    *available_isas().last().unwrap()
}

/// Why a quantized product cannot run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// A row of `row_bytes` is not a whole number of `qtype`'s blocks.
    RowBytes { qtype: QuantType, row_bytes: usize },
    /// The activations' row length `k` is not the weights' `k`.
    InnerDim { x_k: usize, w_k: usize },
    /// An array holds the wrong number of elements.
    Len {
        name: &'static str,
        got: usize,
        want: usize,
    },
    /// A row index is outside the weight's rows.
    RowIndex { index: i64, rows: usize },
    /// The instruction set is not available on this CPU.
    Isa(Isa),
    /// Only Q4_0 has an interleaved layout.
    Interleaved(QuantType),
}

impl std::fmt::Display for QuantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QuantError::RowBytes { qtype, row_bytes } => write!(
                f,
                "a {qtype:?} row of {row_bytes} bytes is not a whole number of {}-byte blocks",
                qtype.block_bytes()
            ),
            QuantError::InnerDim { x_k, w_k } => {
                write!(f, "activations have {x_k} columns, the weight rows {w_k}")
            }
            QuantError::Len { name, got, want } => {
                write!(f, "{name} has {got} elements, expected {want}")
            }
            QuantError::RowIndex { index, rows } => write!(f, "row {index} is outside 0..{rows}"),
            QuantError::Isa(isa) => write!(f, "this CPU cannot run the {} path", isa.name()),
            QuantError::Interleaved(qt) => write!(f, "{qt:?} has no interleaved layout (Q4_0 has)"),
        }
    }
}

impl std::error::Error for QuantError {}

/// A quantized weight matrix: `rows` rows of `k` weights, each row `row_bytes` of whole blocks
/// in GGUF order (a GGUF tensor of shape [k, rows] as stored in the file), or, `interleaved`,
/// Q4_0 rows eight at a time in `interleave`'s layout (the same bytes in another order).
#[derive(Clone, Copy)]
pub struct QuantMatrix<'a> {
    pub qtype: QuantType,
    pub data: &'a [u8],
    pub row_bytes: usize,
    pub interleaved: bool,
}

impl<'a> QuantMatrix<'a> {
    /// Checks that `data` is whole rows of whole blocks.
    pub fn new(qtype: QuantType, data: &'a [u8], row_bytes: usize) -> Result<Self, QuantError> {
        if row_bytes == 0 || !row_bytes.is_multiple_of(qtype.block_bytes()) {
            return Err(QuantError::RowBytes { qtype, row_bytes });
        }
        if !data.len().is_multiple_of(row_bytes) {
            return Err(QuantError::Len {
                name: "weight",
                got: data.len(),
                want: data.len() / row_bytes * row_bytes,
            });
        }
        Ok(QuantMatrix {
            qtype,
            data,
            row_bytes,
            interleaved: false,
        })
    }

    /// A Q4_0 matrix in `interleave`'s layout. Errors for another type, rows that are not whole
    /// blocks or a row count that is not a multiple of eight.
    pub fn new_interleaved(
        qtype: QuantType,
        data: &'a [u8],
        row_bytes: usize,
    ) -> Result<Self, QuantError> {
        if qtype != QuantType::Q4_0 {
            return Err(QuantError::Interleaved(qtype));
        }
        let w = QuantMatrix::new(qtype, data, row_bytes)?;
        interleave::check_rows(w.rows())?;
        Ok(QuantMatrix {
            interleaved: true,
            ..w
        })
    }

    /// Weights per row.
    pub fn k(&self) -> usize {
        self.row_bytes / self.qtype.block_bytes() * self.qtype.block_elems()
    }

    pub fn rows(&self) -> usize {
        self.data.len() / self.row_bytes
    }

    /// Row n's bytes (a row-major matrix only).
    fn row(&self, n: usize) -> &'a [u8] {
        debug_assert!(
            !self.interleaved,
            "an interleaved matrix has no row-major rows"
        );
        &self.data[n * self.row_bytes..(n + 1) * self.row_bytes]
    }
}

/// The eight lanes of an accumulator summed in the fixed order every path uses (the AVX2
/// reduction: halves, then pairs, then the last two).
#[inline(always)]
pub(crate) fn reduce_lanes(a: &[f32; 8]) -> f32 {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// out[m, n] = Σ_k x[m, k] * w[n, k]: `x` [m, k] float32, `w` [rows, k] quantized, `out`
/// [m, rows] float32 (overwritten). Rows of `w` are split over up to `num_threads` threads.
pub fn matmul(
    x: &[f32],
    w: QuantMatrix<'_>,
    out: &mut [f32],
    num_threads: usize,
    isa: Isa,
) -> Result<(), QuantError> {
    let k = w.k();
    if !x.len().is_multiple_of(k) {
        return Err(QuantError::InnerDim {
            x_k: x.len(),
            w_k: k,
        });
    }
    let m = x.len() / k;
    let n = w.rows();
    if out.len() != m * n {
        return Err(QuantError::Len {
            name: "out",
            got: out.len(),
            want: m * n,
        });
    }
    if !available_isas().contains(&isa) {
        return Err(QuantError::Isa(isa));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let product = Product::new(x, w, num_threads, isa);
    // Rows per task: a multiple of 8, about TASKS_PER_THREAD tasks per thread (claimed, see
    // `parallel::run_tasks_on`); threads only where the work is worth one.
    let work = m * n * k / 4; // bytes of int8 products, roughly
    let threads = parallel::threads_for(work, num_threads).min(n.div_ceil(8));
    let per = if threads == 1 {
        n
    } else {
        n.div_ceil(threads * TASKS_PER_THREAD)
            .next_multiple_of(8)
            .min(n)
    };
    let tasks = n.div_ceil(per);
    let out = OutColumns::new(out);
    parallel::run_tasks_on(tasks, threads, &|t| {
        product.run_rows(t * per..((t + 1) * per).min(n), out)
    });
    Ok(())
}

/// One product x @ w^T made ready to run by ranges of weight rows, from any thread: the
/// activations quantized (and, where the format's tiled path applies, regrouped) once. The
/// caller checked shapes and the instruction set (`matmul` does; so does `crate::moe`).
pub(crate) struct Product<'a> {
    act: QuantActivations,
    tiles: Option<block32::ActTiles>,
    w: QuantMatrix<'a>,
    isa: Isa,
}

impl<'a> Product<'a> {
    /// x: [m, w.k()] float32, m >= 1.
    pub(crate) fn new(x: &[f32], w: QuantMatrix<'a>, num_threads: usize, isa: Isa) -> Product<'a> {
        let act = QuantActivations::new(x, w.k(), num_threads);
        let tiles = (block32::applies(w.qtype)
            && !w.interleaved
            && act.rows() > block32::ROW_BY_ROW
            && isa != Isa::Scalar)
            .then(|| block32::ActTiles::new(&act, num_threads));
        Product { act, tiles, w, isa }
    }

    /// out[:, rows] of out [m, w.rows()]: each output is the same bits whichever ranges the
    /// rows are cut into and however many activation rows there are.
    pub(crate) fn run_rows(&self, rows: std::ops::Range<usize>, out: OutColumns) {
        let n = self.w.rows();
        if self.w.interleaved {
            interleave::matmul_rows(&self.act, self.w, rows, out, n, self.isa);
        } else if block32::applies(self.w.qtype) {
            block32::matmul_rows(
                &self.act,
                self.tiles.as_ref(),
                self.w,
                rows,
                out,
                n,
                self.isa,
            );
        } else {
            matmul_rows(&self.act, self.w, rows, out, n, self.isa);
        }
    }
}

/// Tasks a product's weight rows are cut into per thread.
const TASKS_PER_THREAD: usize = 4;

/// A product's output [m, n] as its tasks share it: each task writes only the elements of its
/// own columns, one at a time through the pointer, so no task holds a `&mut` over elements
/// another one writes.
#[derive(Clone, Copy)]
pub(crate) struct OutColumns {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: shared so that tasks can write disjoint elements (see `set`).
unsafe impl Sync for OutColumns {}
unsafe impl Send for OutColumns {}
impl OutColumns {
    /// The product's output: tasks write it through `set`, after which the caller reads it
    /// again (the borrow ends when `matmul`'s tasks have).
    pub(crate) fn new(out: &mut [f32]) -> OutColumns {
        OutColumns {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        }
    }

    /// Element `i` = v.
    ///
    /// # Safety
    /// `i` must be in bounds (checked only in debug builds: a check per element halved the
    /// speed of the tiled products, 2.4-2.7 against 1.1-1.3 cycles a block and row at 1024
    /// rows), and the caller's task the only one that touches
    /// element i during the product (tasks own disjoint columns). The buffer outlives the
    /// product's tasks (`matmul` returns after they all end).
    #[inline(always)]
    pub(crate) unsafe fn set(self, i: usize, v: f32) {
        debug_assert!(i < self.len, "output element {i} of {}", self.len);
        *self.ptr.add(i) = v
    }
}

/// Columns `cols` of out ([m, n]), weight rows outermost (each read from memory once, the
/// activations staying in cache): groups of `C` weight rows against activation rows in tiles
/// of up to 4; C is 4 for the one- or two-row products of decode and 2 otherwise (what fits
/// the 16 AVX2 registers), the last weight rows one at a time.
fn matmul_rows(
    act: &QuantActivations,
    w: QuantMatrix<'_>,
    cols: std::ops::Range<usize>,
    out: OutColumns,
    n: usize,
    isa: Isa,
) {
    let m = act.rows();
    let group = if m <= 2 { 4 } else { 2 };
    let mut col = cols.start;
    while col < cols.end {
        let c = if col + group <= cols.end { group } else { 1 };
        match c {
            4 => weight_rows_at::<4>(act, w, col, out, n, isa),
            2 => weight_rows_at::<2>(act, w, col, out, n, isa),
            _ => weight_rows_at::<1>(act, w, col, out, n, isa),
        }
        col += c;
    }
}

/// The C weight rows from `col` against every activation row, in tiles of up to 4.
#[inline(always)]
fn weight_rows_at<const C: usize>(
    act: &QuantActivations,
    w: QuantMatrix<'_>,
    col: usize,
    out: OutColumns,
    n: usize,
    isa: Isa,
) {
    let m = act.rows();
    let mut m0 = 0;
    while m0 < m {
        let r = (m - m0).min(4);
        match r {
            4 => tile_at::<C, 4>(act, m0, w, col, out, n, isa),
            3 => tile_at::<C, 3>(act, m0, w, col, out, n, isa),
            2 => tile_at::<C, 2>(act, m0, w, col, out, n, isa),
            _ => tile_at::<C, 1>(act, m0, w, col, out, n, isa),
        }
        m0 += r;
    }
}

/// out[m0 + r, col + c] for the R activation rows from m0 and the C weight rows from col.
#[inline(always)]
fn tile_at<const C: usize, const R: usize>(
    act: &QuantActivations,
    m0: usize,
    w: QuantMatrix<'_>,
    col: usize,
    out: OutColumns,
    n: usize,
    isa: Isa,
) {
    let rows: [ActRow<'_>; R] = std::array::from_fn(|i| act.row(m0 + i));
    let got = tile::<C, R>(w.qtype, std::array::from_fn(|c| w.row(col + c)), &rows, isa);
    for (c, res) in got.iter().enumerate() {
        for (i, v) in res.iter().enumerate() {
            // SAFETY: m0 + i < m and col + c < n (the tile's rows and columns), and these
            // columns are this task's
            unsafe { out.set((m0 + i) * n + col + c, *v) };
        }
    }
}

/// res[c][r] = dot(weight row `wrows[c]`, activation row `rows[r]`).
#[inline(always)]
fn tile<const C: usize, const R: usize>(
    qtype: QuantType,
    wrows: [&[u8]; C],
    rows: &[ActRow<'_>; R],
    isa: Isa,
) -> [[f32; R]; C] {
    match isa {
        Isa::Scalar => wrows.map(|wrow| blocks::dot_rows::<R>(qtype, wrow, rows)),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `matmul` checked that this CPU has the instruction set.
        Isa::Avx2 => unsafe { x86::dot_tile_avx2::<C, R>(qtype, &wrows, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx512Vnni => unsafe { x86::dot_tile_vnni::<C, R>(qtype, &wrows, rows) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("only the scalar path exists off x86-64"),
    }
}

/// out[i, :] = the float32 weights of row rows[i] of `w` (out: [len(rows), k]), exactly as
/// ggml / gguf-py dequantize them.
pub fn dequantize_rows(
    w: QuantMatrix<'_>,
    rows: &[i64],
    out: &mut [f32],
) -> Result<(), QuantError> {
    let k = w.k();
    if out.len() != rows.len() * k {
        return Err(QuantError::Len {
            name: "out",
            got: out.len(),
            want: rows.len() * k,
        });
    }
    for &r in rows {
        if r < 0 || r as usize >= w.rows() {
            return Err(QuantError::RowIndex {
                index: r,
                rows: w.rows(),
            });
        }
    }
    for (&r, o) in rows.iter().zip(out.chunks_exact_mut(k)) {
        if w.interleaved {
            blocks::dequantize_row(w.qtype, &interleave::row_major(&w, r as usize), o);
        } else {
            blocks::dequantize_row(w.qtype, w.row(r as usize), o);
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests;
