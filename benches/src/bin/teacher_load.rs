//! A load test of the teacher server (`speculator serve-teacher`), loopback only, bounded in
//! requests and time: N concurrent clients send a mix of valid requests (SGLang token ids,
//! SGLang text, OpenAI text, several prompts per request) and invalid ones (over the
//! prompts-per-request and `max_new_tokens` limits, a body over the size limit, malformed
//! JSON, a wrong API key). Every request must be answered (200 with the generated ids) or
//! refused cleanly (400/401/413 with the error JSON); anything else — a dropped connection,
//! a 5xx, a timeout — fails the run. Reports p50/p99 latency of the answered requests,
//! throughput, the refusals by status, and the process's peak RSS (server and clients share
//! the process), which must stay under `--max-rss-mb`; afterwards the server must still
//! answer. The model is the demo target (`fixtures/demo/target`, 3 layers, hidden 96).
//!
//! `cargo run --release -p kd-benches --bin teacher_load -- --clients 32 --requests 8`

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use kd_benches::proc_status_bytes;
use kd_data::ChatTokenizer;
use kd_model::{Llama, parse_device};
use kd_teacher::{LocalTeacher, ServeConfig, model_fingerprint, spawn_server};

#[derive(Parser, Debug)]
struct Args {
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Requests each client sends.
    #[arg(long, default_value_t = 8)]
    requests: usize,
    /// Stop sending new requests after this many seconds (those in flight finish).
    #[arg(long, default_value_t = 120.0)]
    max_seconds: f64,
    /// New tokens per valid prompt.
    #[arg(long, default_value_t = 16)]
    new_tokens: usize,
    /// The server's batch size.
    #[arg(long, default_value_t = 16)]
    batch_size: usize,
    /// Fail when the process's peak RSS exceeds this.
    #[arg(long, default_value_t = 2048)]
    max_rss_mb: u64,
    /// Per-request client timeout in seconds (a request past it counts as a failure).
    #[arg(long, default_value_t = 120.0)]
    timeout_s: f64,
}

/// What one request was, and what it should get.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    SglIds,
    SglText,
    OaiText,
    SglBatch,
    TooManyPrompts,
    TooManyTokens,
    BodyTooLarge,
    Malformed,
    WrongKey,
}

const KINDS: [Kind; 9] = [
    Kind::SglIds,
    Kind::SglText,
    Kind::OaiText,
    Kind::SglBatch,
    Kind::TooManyPrompts,
    Kind::TooManyTokens,
    Kind::BodyTooLarge,
    Kind::Malformed,
    Kind::WrongKey,
];

impl Kind {
    fn valid(self) -> bool {
        matches!(
            self,
            Kind::SglIds | Kind::SglText | Kind::OaiText | Kind::SglBatch
        )
    }
}

#[derive(Debug)]
struct Outcome {
    kind: Kind,
    status: u16,
    latency: Duration,
    tokens: usize,
}

const KEY: &str = "load-test-key";

async fn one(
    client: &reqwest::Client,
    url: &str,
    kind: Kind,
    i: usize,
    new_tokens: usize,
) -> Result<Outcome> {
    let sp = serde_json::json!({"max_new_tokens": new_tokens, "temperature": 0.7,
                                "sampling_seed": i});
    let ids: Vec<u32> = (0..8 + i % 24)
        .map(|j| (3 + (i * 31 + j * 17) % 900) as u32)
        .collect();
    let (path, body): (&str, Vec<u8>) = match kind {
        Kind::SglIds => (
            "/generate",
            serde_json::to_vec(&serde_json::json!({"input_ids": ids, "sampling_params": sp}))?,
        ),
        Kind::SglText => (
            "/generate",
            serde_json::to_vec(&serde_json::json!({
                "text": format!("Question {i}: what is a computer?"), "sampling_params": sp}))?,
        ),
        Kind::OaiText => (
            "/v1/completions",
            serde_json::to_vec(&serde_json::json!({
                "prompt": format!("Tell me about sports, number {i}."),
                "max_tokens": new_tokens, "temperature": 0.7, "seed": i,
                "return_token_ids": true}))?,
        ),
        Kind::SglBatch => (
            "/generate",
            serde_json::to_vec(&serde_json::json!({
                "input_ids": [ids.clone(), ids[..4].to_vec(), ids[2..].to_vec()],
                "sampling_params": sp}))?,
        ),
        Kind::TooManyPrompts => (
            "/generate",
            serde_json::to_vec(&serde_json::json!({
                "input_ids": vec![ids.clone(); 9], "sampling_params": sp}))?,
        ),
        Kind::TooManyTokens => (
            "/generate",
            serde_json::to_vec(&serde_json::json!({
                "input_ids": ids, "sampling_params": {"max_new_tokens": 100_000}}))?,
        ),
        Kind::BodyTooLarge => (
            "/generate",
            serde_json::to_vec(&serde_json::json!({
                "input_ids": vec![7u32; 600_000], "sampling_params": sp}))?,
        ),
        Kind::Malformed => ("/generate", b"{\"input_ids\": [1, 2,".to_vec()),
        Kind::WrongKey => (
            "/generate",
            serde_json::to_vec(&serde_json::json!({"input_ids": ids, "sampling_params": sp}))?,
        ),
    };
    let key = if kind == Kind::WrongKey { "wrong" } else { KEY };
    let start = Instant::now();
    let response = client
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(body)
        .send()
        .await
        .with_context(|| format!("{kind:?} request {i}: no answer"))?;
    let status = response.status().as_u16();
    let value: serde_json::Value = response
        .json()
        .await
        .with_context(|| format!("{kind:?} request {i}: status {status} without a JSON body"))?;
    let latency = start.elapsed();
    let tokens = if kind.valid() {
        if status != 200 {
            bail!("{kind:?} request {i}: status {status}: {value}");
        }
        let rows: Vec<&serde_json::Value> = match (&value, kind) {
            (serde_json::Value::Array(a), _) => a.iter().collect(),
            (v, Kind::OaiText) => v["choices"]
                .as_array()
                .map(|a| a.iter().collect())
                .unwrap_or_default(),
            (v, _) => vec![v],
        };
        let field = if kind == Kind::OaiText {
            "token_ids"
        } else {
            "output_ids"
        };
        let n: usize = rows
            .iter()
            .map(|r| r[field].as_array().map_or(0, Vec::len))
            .sum();
        if rows.is_empty() || rows.iter().any(|r| r[field].as_array().is_none()) {
            bail!("{kind:?} request {i}: 200 without {field}: {value}");
        }
        n
    } else {
        let clean = matches!(status, 400 | 401 | 413) && value["error"]["message"].is_string();
        if !clean {
            bail!("{kind:?} request {i}: expected a clean refusal, got {status}: {value}");
        }
        0
    };
    Ok(Outcome {
        kind,
        status,
        latency,
        tokens,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() -> Result<()> {
    let args = Args::parse();
    kd_benches::print_machine()?;
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/demo/target");
    let device = parse_device("cpu")?;
    let model = Llama::load_for_inference(&dir, &device)?;
    let teacher = LocalTeacher::new(model, args.batch_size, model_fingerprint(&dir)?)
        .with_tokenizer(ChatTokenizer::from_dir(&dir)?);
    let config = ServeConfig {
        api_key: Some(KEY.into()),
        max_prompts_per_request: 8,
        max_new_tokens: 256,
        max_body_bytes: 1 << 20,
        ..ServeConfig::default()
    };
    let server = spawn_server(teacher, "127.0.0.1:0", config)?;
    let url = server.url();
    let rss_before = proc_status_bytes("VmRSS").unwrap_or(0);
    println!(
        "teacher_load: demo target, {} clients × {} requests ({} kinds, {} valid), {} new \
         tokens, server batch {}, loopback {url}",
        args.clients,
        args.requests,
        KINDS.len(),
        KINDS.iter().filter(|k| k.valid()).count(),
        args.new_tokens,
        args.batch_size
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.max_seconds);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs_f64(args.timeout_s))
        .build()?;
    let url = Arc::new(url);
    let start = Instant::now();
    let results: Vec<Result<Vec<Outcome>>> = rt.block_on(async {
        let mut tasks = Vec::new();
        for c in 0..args.clients {
            let (client, url) = (client.clone(), url.clone());
            let (n, new_tokens) = (args.requests, args.new_tokens);
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                for r in 0..n {
                    if Instant::now() > deadline {
                        break;
                    }
                    let i = c * n + r;
                    out.push(one(&client, &url, KINDS[i % KINDS.len()], i, new_tokens).await?);
                }
                Ok(out)
            }));
        }
        let mut all = Vec::new();
        for t in tasks {
            all.push(
                t.await
                    .unwrap_or_else(|e| Err(anyhow::anyhow!("client task: {e}"))),
            );
        }
        all
    });
    let wall = start.elapsed();
    let mut outcomes = Vec::new();
    let mut failures = Vec::new();
    for r in results {
        match r {
            Ok(o) => outcomes.extend(o),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    let peak = proc_status_bytes("VmHWM").unwrap_or(0);
    // The server still answers afterwards.
    let after = rt.block_on(one(&client, &url, Kind::SglText, 0, 4));
    let mut latencies: Vec<Duration> = outcomes
        .iter()
        .filter(|o| o.kind.valid())
        .map(|o| o.latency)
        .collect();
    latencies.sort();
    let answered = latencies.len();
    let tokens: usize = outcomes.iter().map(|o| o.tokens).sum();
    let mut refused = std::collections::BTreeMap::new();
    for o in outcomes.iter().filter(|o| !o.kind.valid()) {
        *refused.entry((o.kind, o.status)).or_insert(0usize) += 1;
    }
    println!(
        "requests: {} sent, {answered} answered, {} refused cleanly, {} failed, in {:.1} s",
        outcomes.len() + failures.len(),
        outcomes.len() - answered,
        failures.len(),
        wall.as_secs_f64()
    );
    for ((kind, status), n) in &refused {
        println!("  refused {kind:?}: {n} × HTTP {status}");
    }
    println!(
        "answered: latency p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms; {:.1} requests/s, {:.1} \
         generated tokens/s",
        percentile(&latencies, 0.5).as_secs_f64() * 1e3,
        percentile(&latencies, 0.99).as_secs_f64() * 1e3,
        latencies.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        answered as f64 / wall.as_secs_f64(),
        tokens as f64 / wall.as_secs_f64()
    );
    println!(
        "memory: RSS {:.0} MB after loading, peak {:.0} MB (limit {} MB; server and clients in one \
         process)",
        rss_before as f64 / 1e6,
        peak as f64 / 1e6,
        args.max_rss_mb
    );
    println!(
        "afterwards: {}",
        match &after {
            Ok(o) => format!(
                "answered (HTTP {}, {:.0} ms)",
                o.status,
                o.latency.as_secs_f64() * 1e3
            ),
            Err(e) => format!("FAILED: {e:#}"),
        }
    );
    drop(server);
    for f in failures.iter().take(5) {
        eprintln!("failure: {f}");
    }
    if !failures.is_empty() {
        bail!("{} clients failed", failures.len());
    }
    after.context("the server stopped answering after the load")?;
    if peak > args.max_rss_mb << 20 {
        bail!(
            "peak RSS {} MB over the limit of {} MB",
            peak >> 20,
            args.max_rss_mb
        );
    }
    Ok(())
}
