//! The genuine Qwen3 tokenizer and chat template against Python's output.

mod common;

use common::*;
use emlx_axon_engine::{Detokenizer, Tokenizer};
use serde_json::Value;

fn qwen3() -> Tokenizer {
    Tokenizer::load(&fixture("qwen3-4bit-g64")).unwrap()
}

#[test]
fn encodes_the_reference_sentence() {
    let ids = qwen3()
        .encode("The quick brown fox jumps over the lazy dog.", false)
        .unwrap();
    assert_eq!(
        ids,
        vec![785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
    );
}

#[test]
fn encodings_match_python() {
    let t = qwen3();
    let cases = json(fixtures().join("encodings.json"));
    for case in cases.as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(
            t.encode(text, false).unwrap(),
            ids(&case["ids"]),
            "encoding {text:?}"
        );
        assert_eq!(t.decode(&ids(&case["ids"]), false).unwrap(), text);
    }
}

#[test]
fn chat_template_matches_python() {
    let t = qwen3();
    let cases = json(fixtures().join("chat_renders.json"));
    for case in cases.as_array().unwrap() {
        let thinking = case.get("enable_thinking").and_then(Value::as_bool);
        let rendered = t
            .apply_chat_template(
                &case["messages"],
                case["add_generation_prompt"].as_bool().unwrap(),
                thinking,
            )
            .unwrap();
        assert_eq!(
            rendered,
            case["text"].as_str().unwrap(),
            "messages {}",
            case["messages"]
        );
    }
}

#[test]
fn detokenizer_never_splits_a_character() {
    let t = qwen3();
    let text = "naïve café — 你好，世界 🙂🚀 done";
    let ids = t.encode(text, false).unwrap();
    let mut d = Detokenizer::default();
    let mut out = String::new();
    for &id in &ids {
        let piece = d.push(&t, id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "piece {piece:?} holds a partial character"
        );
        out.push_str(&piece);
    }
    out.push_str(&d.flush(&t).unwrap());
    assert_eq!(out, text);
}

#[test]
fn errors_are_typed() {
    assert_eq!(
        Tokenizer::load(std::path::Path::new("/nonexistent"))
            .err()
            .unwrap()
            .kind(),
        "io"
    );
    let t = qwen3();
    assert_eq!(t.decode(&[10_000_000, 785], false).unwrap(), "The");
    let bad = serde_json::json!([{"role": "user"}]);
    assert_eq!(
        t.apply_chat_template(&bad, true, None).unwrap_err().kind(),
        "invalid_argument"
    );
}
