//! The GGUF block formats (ggml `ggml-common.h`, dequantization as in `ggml-quants.c` and
//! gguf-py's `quants.py`), each decoded into one canonical form, and the portable dot product.
//!
//! Canonical form of a block: for every 32 weights, 32 signed integers `w_i` (the format's
//! offset already subtracted: Q4_0 `q - 8`, Q5_0 `q - 16`, Q6_K `q - 32`), eight lane scales
//! (one per four weights: equal for every format but Q6_K, whose 16-weight sub-blocks have
//! their own scale) and one min, so that weight `i` is `scale[i / 4] * w_i + min`. The
//! products `scale` (`d * sc` for the K-quants) and mins (`-(dmin * m)`) are computed in
//! float32 exactly as the reference dequantizers compute them.

use super::{reduce_lanes, ActRow};

/// GGUF quantization types with native kernels; the discriminant is ggml's type id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum QuantType {
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
}

impl QuantType {
    pub const ALL: [QuantType; 8] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q4_K,
        QuantType::Q5_K,
        QuantType::Q6_K,
    ];

    /// The type of ggml type id `id`, if it has kernels.
    pub fn from_ggml(id: u32) -> Option<QuantType> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    /// Weights per block.
    pub fn block_elems(self) -> usize {
        match self {
            QuantType::Q4_K | QuantType::Q5_K | QuantType::Q6_K => 256,
            _ => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4_0 => 18,  // d: f16, qs: 16 x two 4-bit
            QuantType::Q4_1 => 20,  // d, m: f16, qs
            QuantType::Q5_0 => 22,  // d, qh: 32 high bits, qs
            QuantType::Q5_1 => 24,  // d, m, qh, qs
            QuantType::Q8_0 => 34,  // d, qs: 32 x i8
            QuantType::Q4_K => 144, // d, dmin: f16, scales: 12 (8 x 6-bit sc, m), qs: 128
            QuantType::Q5_K => 176, // d, dmin, scales, qh: 32, qs: 128
            QuantType::Q6_K => 210, // ql: 128, qh: 64, scales: 16 x i8, d: f16
        }
    }

    /// Whether weights carry a min (`scale * w + min`), multiplied by the activation sums.
    pub fn has_min(self) -> bool {
        matches!(
            self,
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4_K | QuantType::Q5_K
        )
    }
}

/// IEEE half to single precision (exact, as F16C's `vcvtph2ps`).
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let man = (h & 0x3ff) as u32;
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, _) => {
            // subnormal: shift the mantissa up to an implicit leading one
            let (mut e, mut m) = (127 - 15 + 1, man);
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
        (31, _) => sign | 0x7f80_0000 | (man << 13),
        _ => sign | ((exp + 127 - 15) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

#[inline(always)]
pub(crate) fn half(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// One block in canonical form; `blocks` 32-weight groups are filled (1 or 8).
pub(crate) struct Unpacked {
    pub w: [i8; 256],
    pub scale: [[f32; 8]; 8],
    pub min: [f32; 8],
}

impl Unpacked {
    pub const ZERO: Unpacked = Unpacked {
        w: [0; 256],
        scale: [[0.0; 8]; 8],
        min: [0.0; 8],
    };
}

impl Default for Unpacked {
    fn default() -> Self {
        Unpacked::ZERO
    }
}

/// Scale and min `j` (0..8) of a K-quant's 12 packed 6-bit bytes (ggml's get_scale_min_k4).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Decodes one block (`qt.block_bytes()` bytes) into `u`.
pub(crate) fn unpack(qt: QuantType, b: &[u8], u: &mut Unpacked) {
    let uniform = |u: &mut Unpacked, j: usize, d: f32, m: f32| {
        u.scale[j] = [d; 8];
        u.min[j] = m;
    };
    match qt {
        QuantType::Q4_0 | QuantType::Q4_1 => {
            let (m, qs) = if qt == QuantType::Q4_1 {
                (half(b, 2), &b[4..20])
            } else {
                (0.0, &b[2..18])
            };
            let off = if qt == QuantType::Q4_0 { 8 } else { 0 };
            for (i, &q) in qs.iter().enumerate() {
                u.w[i] = (q & 0xf) as i8 - off;
                u.w[i + 16] = (q >> 4) as i8 - off;
            }
            uniform(u, 0, half(b, 0), m);
        }
        QuantType::Q5_0 | QuantType::Q5_1 => {
            let (m, at) = if qt == QuantType::Q5_1 {
                (half(b, 2), 4)
            } else {
                (0.0, 2)
            };
            let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            let qs = &b[at + 4..at + 20];
            let off = if qt == QuantType::Q5_0 { 16 } else { 0 };
            for (i, &q) in qs.iter().enumerate() {
                let h0 = ((qh >> i) & 1) as u8;
                let h1 = ((qh >> (i + 16)) & 1) as u8;
                u.w[i] = ((q & 0xf) | (h0 << 4)) as i8 - off;
                u.w[i + 16] = ((q >> 4) | (h1 << 4)) as i8 - off;
            }
            uniform(u, 0, half(b, 0), m);
        }
        QuantType::Q8_0 => {
            for (w, &q) in u.w[..32].iter_mut().zip(&b[2..34]) {
                *w = q as i8;
            }
            uniform(u, 0, half(b, 0), 0.0);
        }
        QuantType::Q4_K | QuantType::Q5_K => {
            k_scales(qt, b, u);
            let (qh, qs) = if qt == QuantType::Q5_K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            for s in 0..8 {
                let (pair, shift) = (s / 2, 4 * (s % 2));
                for l in 0..32 {
                    let mut q = (qs[32 * pair + l] >> shift) & 0xf;
                    if let Some(qh) = qh {
                        q |= ((qh[l] >> s) & 1) << 4;
                    }
                    u.w[32 * s + l] = q as i8;
                }
            }
        }
        QuantType::Q6_K => {
            k_scales(qt, b, u);
            let (ql, qh) = (&b[0..128], &b[128..192]);
            for h in 0..2 {
                let (ql, qh) = (&ql[64 * h..64 * h + 64], &qh[32 * h..32 * h + 32]);
                for l in 0..32 {
                    let e = 128 * h + l;
                    u.w[e] = ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32;
                    u.w[e + 32] = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                    u.w[e + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                    u.w[e + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
                }
            }
        }
    }
}

/// The lane scales and mins of a K-quant super-block (its weights are decoded apart, by the
/// portable or the SIMD code).
pub(crate) fn k_scales(qt: QuantType, b: &[u8], u: &mut Unpacked) {
    if qt == QuantType::Q6_K {
        let (sc, d) = (&b[192..208], half(b, 208));
        for j in 0..8 {
            for l in 0..8 {
                // lanes 0-3 are the first 16 weights of the group, 4-7 the second
                u.scale[j][l] = d * sc[2 * j + l / 4] as i8 as f32;
            }
            u.min[j] = 0.0;
        }
        return;
    }
    let (d, dmin, scales) = (half(b, 0), half(b, 2), &b[4..16]);
    for s in 0..8 {
        let (sc, m) = scale_min_k4(s, scales);
        u.scale[s] = [d * sc as f32; 8];
        u.min[s] = -(dmin * m as f32);
    }
}

/// The float32 weights of one row (`row` whole blocks) into `out` (`k` floats).
pub(crate) fn dequantize_row(qt: QuantType, row: &[u8], out: &mut [f32]) {
    let mut u = Unpacked::default();
    let groups = qt.block_elems() / 32;
    for (b, o) in row
        .chunks_exact(qt.block_bytes())
        .zip(out.chunks_exact_mut(qt.block_elems()))
    {
        unpack(qt, b, &mut u);
        for j in 0..groups {
            for i in 0..32 {
                o[32 * j + i] = u.scale[j][i / 4] * u.w[32 * j + i] as f32 + u.min[j];
            }
        }
    }
}

/// Portable dot products of one weight row with R activation rows (the arithmetic every path
/// follows; see the module doc of `quant`).
pub(crate) fn dot_rows<const R: usize>(
    qt: QuantType,
    wrow: &[u8],
    rows: &[ActRow<'_>; R],
) -> [f32; R] {
    let mut acc = [[0f32; 8]; R];
    let mut summ = [0f32; R];
    let mut u = Unpacked::default();
    let groups = qt.block_elems() / 32;
    for (sb, bytes) in wrow.chunks_exact(qt.block_bytes()).enumerate() {
        unpack(qt, bytes, &mut u);
        for j in 0..groups {
            let b = sb * groups + j;
            let w = &u.w[32 * j..32 * j + 32];
            for (a, (acc, summ)) in rows.iter().zip(acc.iter_mut().zip(summ.iter_mut())) {
                let qa = &a.q[32 * b..32 * b + 32];
                for (l, acc) in acc.iter_mut().enumerate() {
                    let lane: i32 = (4 * l..4 * l + 4).map(|i| w[i] as i32 * qa[i] as i32).sum();
                    *acc = (u.scale[j][l] * a.d[b]).mul_add(lane as f32, *acc);
                }
                if qt.has_min() {
                    *summ = u.min[j].mul_add(a.s[b], *summ);
                }
            }
        }
    }
    std::array::from_fn(|r| reduce_lanes(&acc[r]) + summ[r])
}
