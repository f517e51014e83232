//! Question/answer examples: prompt ids, answer labels, truncation, batches.

use kd_data::{
    BadRecordPolicy, BatchOptions, ChatTokenizer, ExampleOptions, IGNORE_INDEX, QaKeys, QaSource,
    collate, plan_batches,
};

use crate::fixtures;

#[test]
fn qa_examples_label_the_answer_and_its_end_of_turn() {
    let tok = ChatTokenizer::from_dir(fixtures().join("llama3-tokenizer")).unwrap();
    let source = QaSource {
        files: vec![fixtures().join("data/qa_sample.json")],
        keys: QaKeys::default(),
        policy: BadRecordPolicy::Error,
    };
    let records: Vec<_> = source.records().collect::<Result<_, _>>().unwrap();
    let eot = tok.token_id("<|eot_id|>").unwrap();
    let opts = ExampleOptions::default();
    let (e, cut) = tok.qa_example(&records[0], &opts).unwrap();
    assert_eq!(cut.examples, 0);
    let prompt = tok.encode_prompt(&records[0].messages).unwrap();
    assert_eq!(&e.input_ids[..prompt.len()], &prompt[..]);
    assert!(e.labels[..prompt.len()].iter().all(|l| *l == IGNORE_INDEX));
    // The answer's tokens and the closing <|eot_id|> are labelled.
    assert_eq!(*e.input_ids.last().unwrap(), eot);
    assert_eq!(*e.labels.last().unwrap(), eot as i64);
    let answer = tok.decode(&e.input_ids[prompt.len()..], true).unwrap();
    assert_eq!(answer, records[0].answer);

    // Batches of examples.
    let examples: Vec<_> = records
        .iter()
        .map(|r| tok.qa_example(r, &opts).unwrap().0)
        .collect();
    let lengths: Vec<usize> = examples.iter().map(|e| e.len()).collect();
    let plan = plan_batches(&lengths, &BatchOptions::default(), 0);
    let batch = collate(&examples, &plan[0], eot, 2048);
    assert_eq!(batch.batch_size, 4);
    assert!(batch.label_tokens() > 0);
}
