//! The local embedding model itself (all-MiniLM-L6-v2 on candle), from the folder
//! `scripts/fetch-model.sh` makes (`MNEMO_LOCAL_MODEL_DIR`, set by scripts/test.sh).

use mnemo_core::Embedder;
use mnemo_models::LocalEmbedder;

fn model() -> LocalEmbedder {
    let dir = std::env::var("MNEMO_LOCAL_MODEL_DIR").expect("MNEMO_LOCAL_MODEL_DIR (scripts/test.sh sets it)");
    LocalEmbedder::load(std::path::Path::new(&dir), "all-MiniLM-L6-v2", 384).expect("the model loads")
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

async fn embed(model: &LocalEmbedder, texts: &[&str]) -> Vec<Vec<f32>> {
    let texts: Vec<String> = texts.iter().map(|t| (*t).to_owned()).collect();
    model.embed(&texts).await.expect("embeds")
}

#[tokio::test]
async fn meaning_decides_distance() {
    let model = model();
    let v = embed(&model, &["I live in Tokyo", "My home is in Tokyo", "I like pizza"]).await;
    assert_eq!((model.dimensions(), v[0].len()), (384, 384));
    let close = cosine(&v[0], &v[1]);
    let far = cosine(&v[0], &v[2]);
    assert!((0.75..0.87).contains(&close), "Tokyo/Tokyo {close}");
    assert!(far < 0.25, "Tokyo/pizza {far}");
}

#[tokio::test]
async fn a_text_embeds_the_same_alone_and_in_a_mixed_batch() {
    let model = model();
    let long = "The quarterly report covers revenue, churn and hiring across every region. ".repeat(20);
    // Of four lengths, in no order: the embedder sorts them into passes and must hand each
    // vector back to its own text.
    let texts = ["I live in Tokyo", long.as_str(), "ok", "Which city did the user say they moved to last spring?"];
    let mixed = embed(&model, &texts).await;
    for (text, vector) in texts.iter().zip(&mixed) {
        let alone = embed(&model, &[text]).await;
        assert!(cosine(&alone[0], vector) > 0.9999, "{text:.20}: padding or the order of passes changed its vector");
        let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "norm {norm}");
    }
}

#[tokio::test]
async fn texts_are_read_past_128_tokens() {
    // The shipped tokenizer cuts at 128 tokens; sentence-transformers reads 256. Two texts that
    // share their first ~150 tokens and differ after must not embed the same.
    let model = model();
    let head = "alpha beta gamma delta epsilon ".repeat(30);
    let a = format!("{head} the meeting moved to Paris in spring");
    let b = format!("{head} my favourite dessert is chocolate cake");
    let v = embed(&model, &[a.as_str(), b.as_str()]).await;
    assert!(cosine(&v[0], &v[1]) < 0.9999, "the tails were cut off");
}

/// The encoder is mnemo's own (`mnemo_models::bert`): its vectors must stay those the model gives,
/// or stored vectors and new queries drift apart. These are the first components of one text's
/// vector, as this encoder gave them when it replaced candle-transformers' `BertModel` (whose
/// vectors it matched to a cosine of 0.9999993 or more on LoCoMo texts, docs/benchmarks.md).
#[tokio::test]
async fn the_encoder_gives_the_model_s_vectors() {
    let model = model();
    let v = embed(&model, &["I live in Tokyo"]).await;
    const FIRST: [f32; 6] = [0.038_034_07, -0.069_763_15, 0.057_126_68, 0.017_895_456, 0.040_446_27, -0.022_241_749];
    for (i, (got, want)) in v[0].iter().zip(FIRST).enumerate() {
        assert!((got - want).abs() < 1e-5, "component {i}: {got} against {want}; first: {:?}", &v[0][..6]);
    }
}
