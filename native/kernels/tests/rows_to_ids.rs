//! The host-function node: its ids are the function's over each row (a
//! strided input included), it runs lazily on the stream, a panic marks its
//! row instead of crossing into C++, and its context is dropped once.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::{data, on_cpu};
use emlx_axon_kernels::{rows_to_ids, FAILED_ROW};
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::{Array, Dtype};

fn argmax_row(row: &[f32]) -> u32 {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as u32
}

#[test]
fn ids_are_the_functions_over_each_row() {
    on_cpu(|| {
        let (rows, width) = (5, 1_000);
        let x = Array::from_slice(&data(rows * width, 3), &[rows as i32, width as i32]);
        // A transposed view: the node packs it before the function sees it.
        let xt = x
            .transpose_axes(&[1, 0])
            .unwrap()
            .transpose_axes(&[1, 0])
            .unwrap();
        let seen = Arc::new(AtomicUsize::new(0));
        for input in [&x, &xt] {
            let counter = seen.clone();
            let ids = rows_to_ids(
                input,
                Box::new(move |_, row| {
                    counter.fetch_add(1, Ordering::SeqCst);
                    argmax_row(row)
                }),
            )
            .unwrap()
            .expect("a float32 matrix on a CPU stream is ours");
            let expected = argmax_axis(input, -1, false)
                .unwrap()
                .as_dtype(Dtype::Uint32)
                .unwrap();
            ids.eval().unwrap();
            expected.eval().unwrap();
            assert_eq!(ids.as_slice::<u32>(), expected.as_slice::<u32>());
        }
        assert_eq!(seen.load(Ordering::SeqCst), 2 * rows);
    });
}

#[test]
fn the_function_runs_when_the_graph_does() {
    on_cpu(|| {
        let x = Array::from_slice(&data(64, 5), &[2, 32]);
        let ran = Arc::new(AtomicUsize::new(0));
        let counter = ran.clone();
        let ids = rows_to_ids(
            &x,
            Box::new(move |i, _| {
                counter.fetch_add(1, Ordering::SeqCst);
                i as u32
            }),
        )
        .unwrap()
        .unwrap();
        assert_eq!(ran.load(Ordering::SeqCst), 0, "built lazily");
        ids.eval().unwrap();
        assert_eq!(ids.as_slice::<u32>(), &[0, 1]);
        assert_eq!(ran.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn a_panic_marks_its_rows_and_the_context_is_dropped_once() {
    on_cpu(|| {
        let x = Array::from_slice(&data(30, 7), &[3, 10]);
        let held = Arc::new(());
        let inside = held.clone();
        let ids = rows_to_ids(
            &x,
            Box::new(move |i, _| {
                let _keep = &inside;
                assert!(i != 1, "row 1 panics, as this test means it to");
                i as u32
            }),
        )
        .unwrap()
        .unwrap();
        ids.eval().unwrap();
        // The panic stops the call over the rows: every row is marked.
        assert_eq!(ids.as_slice::<u32>(), &[FAILED_ROW; 3]);
        drop(ids);
        assert_eq!(Arc::strong_count(&held), 1, "the node dropped its context");
    });
}

#[test]
fn declines_what_it_does_not_take() {
    on_cpu(|| {
        let held = Arc::new(());
        for x in [
            Array::from_slice(&[1i32, 2, 3], &[1, 3]),
            Array::from_slice(&[1f32, 2., 3.], &[3]),
        ] {
            let inside = held.clone();
            let built = rows_to_ids(
                &x,
                Box::new(move |_, _| {
                    let _keep = &inside;
                    0
                }),
            )
            .unwrap();
            assert!(built.is_none());
        }
        assert_eq!(Arc::strong_count(&held), 1, "a declined context is dropped");
    });
}
