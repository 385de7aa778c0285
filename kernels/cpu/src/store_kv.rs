//! Writing new tokens' K and V rows into their KV-pool slots (the paged cache's scatter).

/// For each token t: k_buffer[loc[t]] = k_row(t) and v_buffer[loc[t]] = v_row(t), rows of
/// `row_len` floats (num_kv_heads * head_dim). Checks every slot first: returns Err(slot)
/// naming the first one outside 0..num_slots, having written nothing. Repeated slots are
/// written in token order (the last write wins).
pub fn store_kv<'a>(
    k_buffer: &mut [f32],
    v_buffer: &mut [f32],
    row_len: usize,
    loc: &[i32],
    k_row: impl Fn(usize) -> &'a [f32],
    v_row: impl Fn(usize) -> &'a [f32],
) -> Result<(), i32> {
    assert!(
        row_len > 0 && k_buffer.len() == v_buffer.len() && k_buffer.len().is_multiple_of(row_len),
        "store_kv: bad buffer lengths"
    );
    let num_slots = (k_buffer.len() / row_len) as u64;
    if let Some(&bad) = loc.iter().find(|&&s| s < 0 || s as u64 >= num_slots) {
        return Err(bad);
    }
    for (t, &slot) in loc.iter().enumerate() {
        let start = slot as usize * row_len;
        k_buffer[start..start + row_len].copy_from_slice(k_row(t));
        v_buffer[start..start + row_len].copy_from_slice(v_row(t));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_rows_at_slots_and_refuses_bad_slots_untouched() {
        let (mut k, mut v) = (vec![0f32; 4 * 2], vec![0f32; 4 * 2]);
        let rows = [[1.0, 2.0], [3.0, 4.0]];
        store_kv(&mut k, &mut v, 2, &[3, 1], |t| &rows[t], |t| &rows[1 - t]).unwrap();
        assert_eq!(k, vec![0.0, 0.0, 3.0, 4.0, 0.0, 0.0, 1.0, 2.0]);
        assert_eq!(v, vec![0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 3.0, 4.0]);
        let before = k.clone();
        assert_eq!(
            store_kv(&mut k, &mut v, 2, &[0, 4], |t| &rows[t], |t| &rows[t]),
            Err(4)
        );
        assert_eq!(
            store_kv(&mut k, &mut v, 2, &[-1], |t| &rows[t], |t| &rows[t]),
            Err(-1)
        );
        assert_eq!(k, before);
    }
}
