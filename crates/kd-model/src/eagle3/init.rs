//! Starting a fresh draft's output where the target's is.

use burn::module::Param;
use burn::tensor::Tensor;

use super::Eagle3Draft;
use crate::Llama;
use crate::error::{ModelError, Result};

impl Eagle3Draft {
    /// Starts the draft's output layer as the target's: `lm_head` from the target's LM head
    /// rows of the draft vocabulary (the embedding's when tied), as vLLM's `speculators`
    /// initialises its EAGLE-3 drafts, and the final `norm` from the target's final norm, so
    /// that before training the draft maps a hidden state to the logits the target's own head
    /// gives it over the draft vocabulary. Both stay trainable. The target must have the
    /// draft's width and vocabulary.
    pub fn with_target_head(mut self, target: &Llama) -> Result<Self> {
        let tc = target.config();
        let d = self.config.llama.hidden_size;
        if tc.hidden_size != d || tc.vocab_size != self.vocab.target_vocab() {
            return Err(ModelError::Input(format!(
                "the target's head is [{}, {}]; the draft's head reads [{}, {d}] (vocabulary, \
                 width)",
                tc.vocab_size,
                tc.hidden_size,
                self.vocab.target_vocab()
            )));
        }
        let device = self.lm_head.val().device();
        let rows: Vec<usize> = self
            .vocab
            .target_ids()
            .iter()
            .map(|&t| t as usize)
            .collect();
        let head = target.lm_head_rows(&rows);
        let head = Tensor::<2>::from_data(head, &device).transpose();
        let gamma = target.norm.gamma.val().into_data().convert::<f32>();
        self.lm_head = Param::from_tensor(head);
        self.norm = Param::from_tensor(Tensor::<1>::from_data(gamma, &device));
        Ok(self)
    }
}
