//! One dependency (`kd`), one screen: load a target and a draft, train LoRA on
//! prompt/completion pairs, measure the draft by speculative decoding.
//! `cargo run -p kd-examples --example facade -- /tmp/facade-out`
use kd::prelude::*;

fn main() -> anyhow::Result<()> {
    let out = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "target/facade-out".into());
    let device = parse_device("cpu")?;
    let target = Llama::load("fixtures/demo/target", &device)?;
    let draft = Llama::load("fixtures/demo/draft", &device)?.apply_lora(&LoraConfig::default())?;
    let tokenizer = ChatTokenizer::from_dir("fixtures/demo/target")?;
    let data = vec![PromptCompletion::new("Say hi.", "Hi! How are you?")];
    let (examples, _) = tokenizer.prompt_completion_examples(&data, &ExampleOptions::default())?;
    let config = TrainConfig {
        output_dir: out.into(),
        num_epochs: 2,
        ..TrainConfig::default()
    };
    let (trained, summary) = Trainer::new(config, &CausalLmLoss { weight: 1.0 })
        .run(TrainModel::new(draft), &examples)?;
    let prompts = vec![tokenizer.encode_prompt(&[Message::user("Say hi.")])?];
    let report = evaluate(
        &target,
        &trained.llama.merge_and_unload(),
        &prompts,
        &EvalOptions::default(),
        |_, _, _| {},
    )?;
    println!(
        "{} steps; acceptance {:.1}%",
        summary.global_step,
        100.0 * report.acceptance_rate
    );
    Ok(())
}
