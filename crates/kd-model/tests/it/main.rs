//! Integration tests of kd-model against numbers computed by transformers
//! (fixtures/make_tiny_llamas.py, fixtures/make_tiny_qwens.py, fixtures/make_tokenizer_golden.py).

mod util;

mod autodiff;
mod eagle3;
mod generation;
mod gguf;
mod kquant;
mod levels;
mod lora;
mod ops;
mod parity;
mod qwen;
mod tokenizer;
mod weights;
