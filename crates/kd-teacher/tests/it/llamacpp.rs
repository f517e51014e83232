//! A real third-party teacher server: llama.cpp's `llama-server` serving SmolLM2's GGUF file,
//! driven through `RemoteTeacher` (its native `/completion` and its `/v1/completions`), its
//! greedy completions compared with our local greedy decoding of the same file.
//!
//! Needs `fixtures/build-llama-server.sh` (a CPU build of llama.cpp from the llama-cpp-python
//! sdist, ~20 minutes on 2 cores) and `fixtures/fetch-smollm2.sh`; CI does not build
//! llama.cpp yet, so the test is ignored there:
//! `KD_LLAMA_SERVER=target/llama.cpp/bin/llama-server cargo test -p kd-teacher -- --ignored llama`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kd_data::{ChatTokenizer, Message};
use kd_model::Llama;
use kd_teacher::{
    LocalTeacher, Prompt, RemoteApi, RemoteConfig, RemoteTeacher, SamplingParams, ScoreOptions,
    Teacher,
};

use crate::fixtures;

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `GET /health` answers 200.
fn healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let mut reply = String::new();
    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .is_ok()
        && s.read_to_string(&mut reply).is_ok()
        && reply.starts_with("HTTP/1.1 200")
}

#[test]
#[ignore = "needs llama-server (fixtures/build-llama-server.sh) in KD_LLAMA_SERVER"]
fn llama_server_generates_what_we_generate_locally() {
    let model = fixtures().join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(model.is_file(), "run fixtures/fetch-smollm2.sh first");
    let exe = std::env::var_os("KD_LLAMA_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| fixtures().join("../target/llama.cpp/bin/llama-server"));
    assert!(
        exe.is_file(),
        "{} is missing: run fixtures/build-llama-server.sh",
        exe.display()
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = Server(
        Command::new(&exe)
            .arg("-m")
            .arg(&model)
            .args([
                "-t",
                "2",
                "-c",
                "2048",
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let url = format!("http://127.0.0.1:{port}");
    let start = Instant::now();
    while !healthy(port) {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "llama-server did not start"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let tokenizer = ChatTokenizer::from_gguf(&model).unwrap();
    let questions = [
        "What is the capital of France?",
        "Tell me a joke.",
        "What is 2 + 2?",
        "Name three colors.",
    ];
    let prompts: Vec<Prompt> = questions
        .iter()
        .enumerate()
        .map(|(i, q)| Prompt {
            index: i as u64,
            ids: tokenizer
                .encode_prompt(&[Message::new("user", *q)])
                .unwrap(),
        })
        .collect();
    let params = SamplingParams {
        max_new_tokens: 24,
        stop_token_ids: vec![2], // <|im_end|>
        return_logprobs: true,
        ..SamplingParams::default()
    };
    let remote = |api| {
        RemoteTeacher::new(RemoteConfig {
            url: url.clone(),
            api,
            vocab_size: Some(49_152),
            // One request at a time: llama.cpp's arithmetic depends on which sequences share
            // a batch, so concurrent requests would make its greedy outputs vary.
            max_concurrency: 1,
            ..RemoteConfig::default()
        })
        .unwrap()
    };
    let native = remote(RemoteApi::Llamacpp)
        .generate(&prompts, &params)
        .unwrap();
    let openai = remote(RemoteApi::Openai)
        .generate(&prompts, &params)
        .unwrap();
    for (i, (n, a)) in native.iter().zip(&openai).enumerate() {
        assert!(
            !n.ids.is_empty(),
            "prompt {i}: empty completion from llama-server"
        );
        // Both of its APIs give the same greedy tokens.
        assert_eq!(
            n.ids, a.ids,
            "prompt {i}: /completion and /v1/completions disagree"
        );
    }
    // Ours three ways on the same file: the f32 weights, the packed blocks with f32
    // activations, and the packed blocks with 8-bit activations (llama.cpp's arithmetic).
    let dev = burn::tensor::Device::flex();
    let variants = [
        ("f32 weights", Llama::load(&model, &dev).unwrap()),
        (
            "packed, f32 activations",
            Llama::load_for_inference(&model, &dev).unwrap(),
        ),
        (
            "packed, 8-bit activations",
            Llama::load_for_inference(&model, &dev)
                .unwrap()
                .with_int8_activations(true),
        ),
    ];
    for (name, llama) in variants {
        let ours = LocalTeacher::new(llama, 4, "local")
            .generate(&prompts, &params)
            .unwrap();
        let (mut same, mut total, mut worst) = (0, 0, 0f32);
        for (i, (o, n)) in ours.iter().zip(&native).enumerate() {
            let agree = o.ids.iter().zip(&n.ids).take_while(|(x, y)| x == y).count();
            (same, total) = (same + agree, total + n.ids.len());
            // The log-probabilities of the tokens both chose.
            if let (Some(lo), Some(ln)) = (&o.logprobs, &n.logprobs) {
                for (a, b) in lo.iter().zip(ln).take(agree) {
                    worst = worst.max((a - b).abs());
                }
            }
            eprintln!(
                "{name}: prompt {i} {:?}: llama-server {} tokens, ours {}, first {agree} agree\n  theirs {:?}\n  ours   {:?}",
                questions[i],
                n.ids.len(),
                o.ids.len(),
                tokenizer.decode(&n.ids, true).unwrap(),
                tokenizer.decode(&o.ids, true).unwrap(),
            );
        }
        eprintln!(
            "{name}: {same} of llama-server's {total} tokens agree before the first difference; \
             max |Δ log-prob| over them {worst:.4}"
        );
    }
    // It cannot score, and says why.
    let e = remote(RemoteApi::Llamacpp)
        .score_with(&[prompts[0].ids.clone()], &ScoreOptions::top_k(4))
        .unwrap_err()
        .to_string();
    assert!(e.contains("never of prompt tokens"), "{e}");
}
