//! The inner loops of decode attention in portable Rust, in AVX2 + FMA and in AVX-512
//! intrinsics (x86-64), behind one trait so the attention code is written once and compiled
//! for each. The compiler does not vectorize the several-heads-per-row dot products on its
//! own (it keeps them scalar), hence the explicit intrinsics. AVX-512's 32 registers hold the
//! accumulators of 4 query heads x 64 columns, so one sweep over the V rows of a KV head
//! serves a whole head_dim-64 group.

/// Per-row operations of the attention kernel.
pub(crate) trait RowOps {
    /// Output columns a `Tile` accumulator holds.
    const TILE: usize;

    /// Accumulator of TILE output columns of one query head.
    type Tile: Copy;

    /// dots[h] = q[h * d .. (h + 1) * d] . k, where d = k.len(). Panics unless
    /// q.len() == G * k.len().
    fn dot_heads<const G: usize>(q: &[f32], k: &[f32]) -> [f32; G];

    fn tile_zero() -> Self::Tile;

    /// acc[h] += p[h] * v for each of the G heads. Panics unless v.len() == TILE.
    fn tile_axpy<const G: usize>(acc: &mut [Self::Tile; G], p: &[f32; G], v: &[f32]);

    /// out[0..TILE] = acc * scale. Panics unless out.len() == TILE.
    fn tile_store(acc: Self::Tile, scale: f32, out: &mut [f32]);
}

/// Portable implementation (any CPU).
pub(crate) struct Portable;

const PORTABLE_TILE: usize = 16;

impl RowOps for Portable {
    const TILE: usize = PORTABLE_TILE;
    type Tile = [f32; PORTABLE_TILE];

    #[inline(always)]
    fn dot_heads<const G: usize>(q: &[f32], k: &[f32]) -> [f32; G] {
        let d = k.len();
        assert_eq!(q.len(), G * d);
        let mut dots = [0f32; G];
        for (h, dot) in dots.iter_mut().enumerate() {
            let mut lanes = [0f32; 8];
            for (i, (x, y)) in q[h * d..(h + 1) * d].iter().zip(k).enumerate() {
                lanes[i % 8] += x * y;
            }
            *dot = lanes.iter().sum();
        }
        dots
    }

    #[inline(always)]
    fn tile_zero() -> Self::Tile {
        [0.0; PORTABLE_TILE]
    }

    #[inline(always)]
    fn tile_axpy<const G: usize>(acc: &mut [Self::Tile; G], p: &[f32; G], v: &[f32]) {
        let v: &[f32; PORTABLE_TILE] = v.try_into().unwrap();
        for h in 0..G {
            for l in 0..PORTABLE_TILE {
                acc[h][l] += p[h] * v[l];
            }
        }
    }

    #[inline(always)]
    fn tile_store(acc: Self::Tile, scale: f32, out: &mut [f32]) {
        let out: &mut [f32; PORTABLE_TILE] = out.try_into().unwrap();
        for l in 0..PORTABLE_TILE {
            out[l] = acc[l] * scale;
        }
    }
}

/// AVX2 + FMA implementation. Only code compiled with those features enabled and run after
/// `is_x86_feature_detected!` said yes may use it (see `decode_attention`).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl RowOps for Avx2 {
    const TILE: usize = 16;
    type Tile = [std::arch::x86_64::__m256; 2];

    #[inline(always)]
    fn dot_heads<const G: usize>(q: &[f32], k: &[f32]) -> [f32; G] {
        use std::arch::x86_64::*;
        let d = k.len();
        assert_eq!(q.len(), G * d);
        let chunks = d / 8;
        // SAFETY: every load reads 8 floats at offsets below chunks * 8 <= d of k and of row h
        // of q (length G * d, checked above); the CPU has AVX2 and FMA (type's contract).
        unsafe {
            let mut acc = [_mm256_setzero_ps(); G];
            for c in 0..chunks {
                let kv = _mm256_loadu_ps(k.as_ptr().add(c * 8));
                for (h, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.as_ptr().add(h * d + c * 8)), kv, *a);
                }
            }
            let mut dots = [0f32; G];
            for h in 0..G {
                let v = acc[h];
                let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
                let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                let s = _mm_add_ss(s, _mm_movehdup_ps(s));
                let mut dot = _mm_cvtss_f32(s);
                for i in chunks * 8..d {
                    dot += q[h * d + i] * k[i];
                }
                dots[h] = dot;
            }
            dots
        }
    }

    #[inline(always)]
    fn tile_zero() -> Self::Tile {
        // SAFETY: AVX is available (type's contract).
        unsafe { [std::arch::x86_64::_mm256_setzero_ps(); 2] }
    }

    #[inline(always)]
    fn tile_axpy<const G: usize>(acc: &mut [Self::Tile; G], p: &[f32; G], v: &[f32]) {
        use std::arch::x86_64::*;
        assert_eq!(v.len(), 16);
        // SAFETY: v holds TILE = 16 floats; AVX2 and FMA are available (type's contract).
        unsafe {
            let v0 = _mm256_loadu_ps(v.as_ptr());
            let v1 = _mm256_loadu_ps(v.as_ptr().add(8));
            for h in 0..G {
                let ph = _mm256_set1_ps(p[h]);
                acc[h][0] = _mm256_fmadd_ps(ph, v0, acc[h][0]);
                acc[h][1] = _mm256_fmadd_ps(ph, v1, acc[h][1]);
            }
        }
    }

    #[inline(always)]
    fn tile_store(acc: Self::Tile, scale: f32, out: &mut [f32]) {
        use std::arch::x86_64::*;
        assert_eq!(out.len(), 16);
        // SAFETY: out holds TILE = 16 floats; AVX is available (type's contract).
        unsafe {
            let s = _mm256_set1_ps(scale);
            _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(acc[0], s));
            _mm256_storeu_ps(out.as_mut_ptr().add(8), _mm256_mul_ps(acc[1], s));
        }
    }
}

/// AVX-512F implementation. Only code compiled with avx512f enabled and run after
/// `is_x86_feature_detected!("avx512f")` said yes may use it (see `decode_attention`).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl RowOps for Avx512 {
    const TILE: usize = 64;
    type Tile = [std::arch::x86_64::__m512; 4];

    #[inline(always)]
    fn dot_heads<const G: usize>(q: &[f32], k: &[f32]) -> [f32; G] {
        use std::arch::x86_64::*;
        let d = k.len();
        assert_eq!(q.len(), G * d);
        if !d.is_multiple_of(16) {
            // head_dim 8, 24, ...: AVX2's 8-float chunks cover it (AVX-512F CPUs have AVX2 and
            // FMA); 16-float chunks would leave it to the scalar tail.
            return Avx2::dot_heads::<G>(q, k);
        }
        let chunks = d / 16;
        // SAFETY: every load reads 16 floats at offsets below chunks * 16 <= d of k and of row
        // h of q (length G * d, checked above); the CPU has AVX-512F (type's contract).
        unsafe {
            let mut acc = [_mm512_setzero_ps(); G];
            for c in 0..chunks {
                let kv = _mm512_loadu_ps(k.as_ptr().add(c * 16));
                for (h, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(q.as_ptr().add(h * d + c * 16)), kv, *a);
                }
            }
            let mut dots = [0f32; G];
            for h in 0..G {
                let mut dot = _mm512_reduce_add_ps(acc[h]);
                for i in chunks * 16..d {
                    dot += q[h * d + i] * k[i];
                }
                dots[h] = dot;
            }
            dots
        }
    }

    #[inline(always)]
    fn tile_zero() -> Self::Tile {
        // SAFETY: AVX-512F is available (type's contract).
        unsafe { [std::arch::x86_64::_mm512_setzero_ps(); 4] }
    }

    #[inline(always)]
    fn tile_axpy<const G: usize>(acc: &mut [Self::Tile; G], p: &[f32; G], v: &[f32]) {
        use std::arch::x86_64::*;
        assert_eq!(v.len(), 64);
        // SAFETY: v holds TILE = 64 floats; AVX-512F is available (type's contract).
        unsafe {
            let vs = [0, 16, 32, 48].map(|o| _mm512_loadu_ps(v.as_ptr().add(o)));
            for h in 0..G {
                let ph = _mm512_set1_ps(p[h]);
                for i in 0..4 {
                    acc[h][i] = _mm512_fmadd_ps(ph, vs[i], acc[h][i]);
                }
            }
        }
    }

    #[inline(always)]
    fn tile_store(acc: Self::Tile, scale: f32, out: &mut [f32]) {
        use std::arch::x86_64::*;
        assert_eq!(out.len(), 64);
        // SAFETY: out holds TILE = 64 floats; AVX-512F is available (type's contract).
        unsafe {
            let s = _mm512_set1_ps(scale);
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(16 * i), _mm512_mul_ps(*a, s));
            }
        }
    }
}

/// Sum of f(x[i]), accumulated in 16 independent partial sums so the compiler vectorizes it
/// (an in-order float sum cannot be).
#[inline(always)]
pub(crate) fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = x.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().map(|&v| f(v)).sum();
    for c in chunks {
        for l in 0..16 {
            acc[l] += f(c[l]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Defines `fn $name(args) [-> ret]` running `$body` compiled twice: with AVX2 and FMA enabled (chosen
/// at run time when the CPU has them, so its loops are vectorized 8 floats wide) and for
/// baseline x86-64 / other targets.
macro_rules! avx2_dispatch {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    // SAFETY: the CPU supports the features `avx2` is compiled for.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use avx2_dispatch;
