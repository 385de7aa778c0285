//! pyo3 bindings of the mixture-of-experts kernel (`moe`): the conventions are `python`'s
//! (numpy arrays in, the result written into `out`, the GIL released while it runs).

use numpy::{PyReadonlyArray2, PyReadonlyArray3, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::exceptions::{PyIndexError, PyValueError};
use pyo3::prelude::*;

use crate::moe::{self, ExpertWeights, MoeError, MoeShape};

use crate::python::{c_slice, c_slice_mut, check_disjoint, span};
use crate::python_quant::{quant_error, quant_isa, quant_matrix};

fn moe_error(e: MoeError) -> PyErr {
    match e {
        MoeError::ExpertId(_) => PyIndexError::new_err(e.to_string()),
        MoeError::Quant(q) => quant_error(q),
        MoeError::Shape(m) => PyValueError::new_err(m),
    }
}

/// The routing arrays and output as slices, checked against x [T, H] and each other.
struct Call<'a> {
    x: &'a [f32],
    ids: &'a [i32],
    weights: &'a [f32],
    out: &'a mut [f32],
    hidden: usize,
    top_k: usize,
}

fn call<'a>(
    x: &'a PyReadonlyArray2<'_, f32>,
    ids: &'a PyReadonlyArray2<'_, i32>,
    weights: &'a PyReadonlyArray2<'_, f32>,
    out: &'a mut PyReadwriteArray2<'_, f32>,
) -> PyResult<Call<'a>> {
    let (xs, is, ws, os) = (
        x.shape(),
        ids.shape(),
        weights.shape(),
        out.shape().to_vec(),
    );
    if is != ws || is[0] != xs[0] || os != xs {
        return Err(PyValueError::new_err(format!(
            "moe: x {xs:?}, ids {is:?}, weights {ws:?} and out {os:?} do not fit ([T, H], [T, k], [T, k], [T, H])"
        )));
    }
    let (hidden, top_k) = (xs[1], is[1]);
    Ok(Call {
        x: c_slice("x", x)?,
        ids: c_slice("ids", ids)?,
        weights: c_slice("weights", weights)?,
        out: c_slice_mut("out", out)?,
        hidden,
        top_k,
    })
}

/// moe_experts(x, ids, weights, gate_up, down, out, expert_start=0, total_experts=None,
/// num_threads=1): out = Σ_j weights[t, j] · expert_{ids[t, j]}(x[t]) over float32 SwiGLU
/// experts (kernels/cpu/src/moe.rs). x, out: [T, H] float32; ids: [T, k] int32 global expert
/// ids; weights: [T, k] float32; gate_up: [E, 2I, H] float32 (gate rows, then up rows); down:
/// [E, H, I]. This call holds experts expert_start..expert_start + E of total_experts (None: E);
/// assignments to others are skipped. Raises ValueError (shapes, layouts, overlap) or IndexError
/// (an id outside 0..total_experts); out is untouched then.
#[pyfunction]
#[pyo3(signature = (x, ids, weights, gate_up, down, out, expert_start=0, total_experts=None, num_threads=1))]
#[allow(clippy::too_many_arguments)]
fn moe_experts(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    ids: PyReadonlyArray2<'_, i32>,
    weights: PyReadonlyArray2<'_, f32>,
    gate_up: PyReadonlyArray3<'_, f32>,
    down: PyReadonlyArray3<'_, f32>,
    mut out: PyReadwriteArray2<'_, f32>,
    expert_start: usize,
    total_experts: Option<usize>,
    num_threads: usize,
) -> PyResult<()> {
    let (gs, ds) = (gate_up.shape().to_vec(), down.shape().to_vec());
    let c = call(&x, &ids, &weights, &mut out)?;
    if gs[0] != ds[0] || gs[1] != 2 * ds[2] || gs[2] != c.hidden || ds[1] != c.hidden {
        return Err(PyValueError::new_err(format!(
            "moe_experts: gate_up {gs:?} and down {ds:?} are not [E, 2I, {h}] and [E, {h}, I]",
            h = c.hidden
        )));
    }
    let shape = MoeShape {
        hidden: c.hidden,
        inter: ds[2],
        num_experts: ds[0],
        expert_start,
        total_experts: total_experts.unwrap_or(ds[0]),
        top_k: c.top_k,
    };
    let experts = ExpertWeights::F32 {
        gate_up: c_slice("gate_up", &gate_up)?,
        down: c_slice("down", &down)?,
    };
    let ExpertWeights::F32 {
        gate_up: g,
        down: d,
    } = experts
    else {
        unreachable!()
    };
    run(
        py,
        c,
        experts,
        shape,
        num_threads,
        crate::quant::best_isa(),
        &[span(g), span(d)],
    )
}

/// moe_experts_quant(x, ids, weights, gate_up, gate_up_type, down, down_type, out,
/// expert_start=0, total_experts=None, num_threads=1, isa=None): `moe_experts` over experts
/// held as GGUF blocks: gate_up [E·2I, row_bytes] uint8 of ggml type gate_up_type (each
/// expert's I gate rows then I up rows, of H weights), down [E·H, row_bytes] uint8 (rows of I
/// weights). Activations are rounded to int8 per block of 32 before each product, as in
/// quant_matmul. isa: as quant_matmul's.
#[pyfunction]
#[pyo3(signature = (x, ids, weights, gate_up, gate_up_type, down, down_type, out, expert_start=0, total_experts=None, num_threads=1, isa=None))]
#[allow(clippy::too_many_arguments)]
fn moe_experts_quant(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    ids: PyReadonlyArray2<'_, i32>,
    weights: PyReadonlyArray2<'_, f32>,
    gate_up: PyReadonlyArray2<'_, u8>,
    gate_up_type: u32,
    down: PyReadonlyArray2<'_, u8>,
    down_type: u32,
    mut out: PyReadwriteArray2<'_, f32>,
    expert_start: usize,
    total_experts: Option<usize>,
    num_threads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let gu = quant_matrix(&gate_up, gate_up_type)?;
    let dn = quant_matrix(&down, down_type)?;
    let isa = quant_isa(isa)?;
    let c = call(&x, &ids, &weights, &mut out)?;
    let h = c.hidden;
    if h == 0 || !dn.rows().is_multiple_of(h) || gu.rows() != dn.rows() / h * 2 * dn.k() {
        return Err(PyValueError::new_err(format!(
            "moe_experts_quant: gate_up of {} rows and down of {} rows of {} do not make experts over hidden size {h}",
            gu.rows(),
            dn.rows(),
            dn.k()
        )));
    }
    let num_experts = dn.rows() / h;
    let shape = MoeShape {
        hidden: h,
        inter: dn.k(),
        num_experts,
        expert_start,
        total_experts: total_experts.unwrap_or(num_experts),
        top_k: c.top_k,
    };
    let read = [span(gu.data), span(dn.data)];
    run(
        py,
        c,
        ExpertWeights::Quant {
            gate_up: gu,
            down: dn,
        },
        shape,
        num_threads,
        isa,
        &read,
    )
}

fn run(
    py: Python<'_>,
    c: Call<'_>,
    experts: ExpertWeights<'_>,
    shape: MoeShape,
    num_threads: usize,
    isa: crate::quant::Isa,
    weight_spans: &[std::ops::Range<usize>; 2],
) -> PyResult<()> {
    check_disjoint(
        &[("out", span(c.out))],
        &[
            ("x", span(c.x)),
            ("ids", span(c.ids)),
            ("weights", span(c.weights)),
            ("gate_up", weight_spans[0].clone()),
            ("down", weight_spans[1].clone()),
        ],
    )?;
    let Call {
        x,
        ids,
        weights,
        out,
        ..
    } = c;
    py.detach(|| moe::fused_experts(x, ids, weights, experts, shape, out, num_threads, isa))
        .map_err(moe_error)
}

/// moe_router_logits(x, gate, out, num_threads=1): out [T, E] = x [T, H] @ gate [E, H]^T, all
/// float32, each logit the same bits at any T (so routing does not depend on the batch).
/// Raises ValueError (shapes, layouts, overlap).
#[pyfunction]
#[pyo3(signature = (x, gate, out, num_threads=1))]
fn moe_router_logits(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    gate: PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArray2<'_, f32>,
    num_threads: usize,
) -> PyResult<()> {
    let (xs, gs, os) = (
        x.shape().to_vec(),
        gate.shape().to_vec(),
        out.shape().to_vec(),
    );
    if xs[1] != gs[1] || os != [xs[0], gs[0]] {
        return Err(PyValueError::new_err(format!(
            "moe_router_logits: x {xs:?}, gate {gs:?} and out {os:?} are not [T, H], [E, H], [T, E]"
        )));
    }
    let (x, gate) = (c_slice("x", &x)?, c_slice("gate", &gate)?);
    let out = c_slice_mut("out", &mut out)?;
    check_disjoint(
        &[("out", span(out))],
        &[("x", span(x)), ("gate", span(gate))],
    )?;
    py.detach(|| moe::router_logits(x, gate, xs[1], out, num_threads))
        .map_err(moe_error)
}

/// moe_route(logits, top_k, renormalize, weights, ids): each token's top_k experts of
/// logits [T, E] float32 (softmax in float32, descending, ties to the lower id) into ids [T, k]
/// int32 and their probabilities into weights [T, k] float32, divided by their sum when
/// `renormalize` (kernels/cpu/src/moe_route.rs). Raises ValueError (shapes, layouts).
#[pyfunction]
fn moe_route(
    logits: PyReadonlyArray2<'_, f32>,
    top_k: usize,
    renormalize: bool,
    mut weights: PyReadwriteArray2<'_, f32>,
    mut ids: PyReadwriteArray2<'_, i32>,
) -> PyResult<()> {
    let (tokens, experts) = (logits.shape()[0], logits.shape()[1]);
    if weights.shape() != [tokens, top_k] || ids.shape() != [tokens, top_k] {
        return Err(PyValueError::new_err(format!(
            "moe_route: weights {:?} and ids {:?} must be [{tokens}, {top_k}]",
            weights.shape(),
            ids.shape()
        )));
    }
    let logits = c_slice("logits", &logits)?;
    let weights = c_slice_mut("weights", &mut weights)?;
    let ids = c_slice_mut("ids", &mut ids)?;
    crate::moe_route::route(logits, experts, top_k, renormalize, weights, ids).map_err(moe_error)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(moe_route, m)?)?;
    m.add_function(wrap_pyfunction!(moe_experts, m)?)?;
    m.add_function(wrap_pyfunction!(moe_experts_quant, m)?)?;
    m.add_function(wrap_pyfunction!(moe_router_logits, m)?)?;
    Ok(())
}
