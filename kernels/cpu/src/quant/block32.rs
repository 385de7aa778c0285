//! The formats with 32-weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): their products, portable,
//! and the driver of the SIMD ones (`block32_x86`).
//!
//! Arithmetic (every path, every batch size, bit for bit): a block's weights are its codes
//! `u_i` (unsigned 0..15 or 0..31; Q8_0's signed int8) with one scale `sc` and one min `mn`,
//! weight `i` being `sc * u_i + mn`; the 4- and 5-bit formats without a min fold their offset
//! into it (Q4_0 `mn = -8 * sc`, Q5_0 `-16 * sc`, exact in float32), Q8_0 has `mn = 0`. With
//! the activation block's int8 `q_i`, scale `d` and scaled sum `s = d * Σq_i`, each block adds
//! to one float32 accumulator
//!
//! ```text
//! acc = fma(sc * d, Σ u_i q_i, acc)     (the integer sum exact in int32)
//! acc = fma(mn, s, acc)
//! ```
//!
//! Why these formats differ from the K-quants (`x86::dot_tile_*`): a whole block's integer sum
//! can be kept, so eight activation rows' sums with one weight row share one register, one
//! int32 lane per row (`block32_x86::tiles`, the weight's four-byte groups broadcast across
//! the lanes), and the float work per block is one multiply-add per row instead of one per
//! four weights. A result does not depend on how many rows are multiplied together: products
//! of up to three rows (decode) run row by row (`block32_x86::row4`, four weight rows' lanes
//! reduced to the same integer sums), larger ones in tiles of eight rows, four tiles at a time
//! on AVX2 (int16 partial sums, `block32_x86::sum_i16_groups`), two on AVX-512 (one 512-bit
//! register of sixteen rows).

#[cfg(target_arch = "x86_64")]
use super::block32_x86;
use super::blocks::{half, QuantType};
use super::{ActRow, Isa, OutColumns, QuantActivations};
use crate::parallel;

/// Whether `qt` is one of the formats of this module.
pub(crate) fn applies(qt: QuantType) -> bool {
    matches!(
        qt,
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q8_0
    )
}

/// One block's codes (unsigned, but Q8_0's signed int8), scale and min (see the module doc).
#[inline(always)]
pub(crate) fn unpack(qt: QuantType, b: &[u8]) -> ([i32; 32], f32, f32) {
    let sc = half(b, 0);
    let mut u = [0i32; 32];
    if qt == QuantType::Q8_0 {
        for (u, &q) in u.iter_mut().zip(&b[2..34]) {
            *u = q as i8 as i32;
        }
        return (u, sc, 0.0);
    }
    let (mn, qh, qs) = match qt {
        QuantType::Q4_0 => (-8.0 * sc, 0, &b[2..18]),
        QuantType::Q4_1 => (half(b, 2), 0, &b[4..20]),
        QuantType::Q5_0 => (
            -16.0 * sc,
            u32::from_le_bytes([b[2], b[3], b[4], b[5]]),
            &b[6..22],
        ),
        QuantType::Q5_1 => (
            half(b, 2),
            u32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            &b[8..24],
        ),
        _ => unreachable!("not a 32-weight format"),
    };
    for (i, &q) in qs.iter().enumerate() {
        u[i] = ((q & 0xf) | ((((qh >> i) & 1) as u8) << 4)) as i32;
        u[i + 16] = ((q >> 4) | ((((qh >> (i + 16)) & 1) as u8) << 4)) as i32;
    }
    (u, sc, mn)
}

/// The portable product of one weight row with one activation row.
pub(crate) fn dot_row(qt: QuantType, wrow: &[u8], a: &ActRow<'_>) -> f32 {
    let mut acc = 0f32;
    for (b, bytes) in wrow.chunks_exact(qt.block_bytes()).enumerate() {
        let (u, sc, mn) = unpack(qt, bytes);
        let qa = &a.q[32 * b..32 * b + 32];
        let isum: i32 = u.iter().zip(qa).map(|(&w, &x)| w * x as i32).sum();
        acc = (sc * a.d[b]).mul_add(isum as f32, acc);
        acc = mn.mul_add(a.s[b], acc);
    }
    acc
}

/// Activations regrouped for `block32_x86::tile8`: rows in tiles of eight (the last padded with
/// zero rows, whose products are zero and dropped), and within a tile, per block, eight 32-byte
/// vectors, vector `i` holding bytes `4i..4i + 4` of each of the eight rows; then the eight rows'
/// `d` and `s` of each block.
pub(crate) struct ActTiles {
    /// Blocks per row.
    pub kb: usize,
    /// [tiles][kb][8 vectors][8 rows][4] int8.
    pub q: Vec<i8>,
    /// [tiles][kb][8 rows] scales and scaled sums.
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

impl ActTiles {
    /// Regroups `act`, tiles spread over up to `num_threads` threads.
    pub fn new(act: &QuantActivations, num_threads: usize) -> ActTiles {
        let (k, m) = (act.k, act.rows());
        let kb = k / 32;
        let tiles = m.div_ceil(8);
        let mut t = ActTiles {
            kb,
            q: vec![0; tiles * kb * 256],
            d: vec![0.0; tiles * kb * 8],
            s: vec![0.0; tiles * kb * 8],
        };
        let chunks: Vec<_> =
            t.q.chunks_mut(kb * 256)
                .zip(t.d.chunks_mut(kb * 8).zip(t.s.chunks_mut(kb * 8)))
                .map(std::sync::Mutex::new)
                .collect();
        let threads = parallel::threads_for(m * k, num_threads);
        parallel::run_tasks_on(tiles, threads, &|tile| {
            let mut chunk = chunks[tile].lock().unwrap();
            let (q, (d, s)) = &mut *chunk;
            for r in 8 * tile..(8 * tile + 8).min(m) {
                let lane = r % 8;
                for b in 0..kb {
                    d[b * 8 + lane] = act.d[r * kb + b];
                    s[b * 8 + lane] = act.s[r * kb + b];
                    for i in 0..8 {
                        let dst = (b * 8 + i) * 32 + 4 * lane;
                        let src = r * k + 32 * b + 4 * i;
                        q[dst..dst + 4].copy_from_slice(&act.q[src..src + 4]);
                    }
                }
            }
        });
        drop(chunks);
        t
    }

    /// Tile `t`: (q, d, s) as the kernel reads them.
    pub fn tile(&self, t: usize) -> (&[i8], &[f32], &[f32]) {
        let (q, f) = (self.kb * 256, self.kb * 8);
        (
            &self.q[t * q..(t + 1) * q],
            &self.d[t * f..(t + 1) * f],
            &self.s[t * f..(t + 1) * f],
        )
    }
}

/// Up to this many activation rows, a product runs row by row: a tile of eight costs about as
/// much as three rows (measured on the quantized LM head, 2.8 cycles a block and row in a half-empty
/// tile against 3.3 for one row alone).
pub(crate) const ROW_BY_ROW: usize = 3;

/// Columns `cols` of out ([m, n]) for a weight of these formats: weight rows in groups of four
/// (the last group repeating its last row, whose extra results are dropped), each group against
/// the one activation row (decode) or against every tile of eight rows.
pub(crate) fn matmul_rows(
    act: &QuantActivations,
    tiles: Option<&ActTiles>,
    w: super::QuantMatrix<'_>,
    cols: std::ops::Range<usize>,
    out: OutColumns,
    n: usize,
    isa: Isa,
) {
    let m = act.rows();
    let row = |r: usize| act.row(r);
    let mut col = cols.start;
    while col < cols.end {
        let valid = (cols.end - col).min(4);
        let wrows: [&[u8]; 4] = std::array::from_fn(|c| w.row(col + c.min(valid - 1)));
        match isa {
            Isa::Scalar => {
                for r in 0..m {
                    for (c, wrow) in wrows.iter().take(valid).enumerate() {
                        // SAFETY: r < m, col + c < n, and these columns are this task's
                        unsafe { out.set(r * n + col + c, dot_row(w.qtype, wrow, &row(r))) };
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            _ => {
                let vnni = isa == Isa::Avx512Vnni;
                if m <= ROW_BY_ROW {
                    for r in 0..m {
                        // SAFETY: `matmul` checked that this CPU has the instruction set.
                        let got = unsafe { block32_x86::row4(w.qtype, &wrows, &row(r), vnni) };
                        for (c, v) in got.iter().take(valid).enumerate() {
                            // SAFETY: as above
                            unsafe { out.set(r * n + col + c, *v) };
                        }
                    }
                } else {
                    let tiles = tiles.expect("tiles are built for products of several rows");
                    let num_tiles = m.div_ceil(8);
                    let mut store = |t: usize, c: usize, lanes: &[f32; 8]| {
                        for (r, v) in lanes.iter().enumerate().take((m - 8 * t).min(8)) {
                            // SAFETY: 8t + r < m (the take), col + c < n (valid), this task's
                            unsafe { out.set((8 * t + r) * n + col + c, *v) };
                        }
                    };
                    let mut t = 0;
                    while t < num_tiles {
                        // SAFETY (each call): as above; each tile holds the k of every weight row.
                        // AVX2: four tiles share each weight block's decoding and broadcasts
                        // (~10% faster than two at 1024 rows); AVX-512: two in one register
                        let step = if !vnni && t + 4 <= num_tiles {
                            let group = std::array::from_fn(|i| tiles.tile(t + i));
                            let got =
                                unsafe { block32_x86::tiles::<4>(w.qtype, &wrows, &group, false) };
                            store_tiles(&got, t, valid, &mut store);
                            4
                        } else if t + 2 <= num_tiles {
                            let group = [tiles.tile(t), tiles.tile(t + 1)];
                            let got = if vnni {
                                unsafe { block32_x86::tiles16(w.qtype, &wrows, &group) }
                            } else {
                                unsafe { block32_x86::tiles::<2>(w.qtype, &wrows, &group, false) }
                            };
                            store_tiles(&got, t, valid, &mut store);
                            2
                        } else {
                            let group = [tiles.tile(t)];
                            let got =
                                unsafe { block32_x86::tiles::<1>(w.qtype, &wrows, &group, vnni) };
                            store_tiles(&got, t, valid, &mut store);
                            1
                        };
                        t += step;
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("only the scalar path exists off x86-64"),
        }
        col += valid;
    }
}

/// Hands `got[c][i]` (weight row c of the group, tile first_tile + i) to `store` for the first
/// `valid` weight rows.
#[cfg(target_arch = "x86_64")]
fn store_tiles<const T: usize>(
    got: &[[[f32; 8]; T]; 4],
    first_tile: usize,
    valid: usize,
    store: &mut impl FnMut(usize, usize, &[f32; 8]),
) {
    for (c, per_tile) in got.iter().take(valid).enumerate() {
        for (i, lanes) in per_tile.iter().enumerate() {
            store(first_tile + i, c, lanes);
        }
    }
}
