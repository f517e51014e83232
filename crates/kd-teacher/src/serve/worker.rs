//! The worker thread that owns the model: it batches the jobs of all connections.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::error::{Result, TeacherError};
use crate::local::{LocalTeacher, Teacher};
use crate::types::{Generation, LAST_HIDDEN_LAYER, SamplingParams, ScoreOptions, Scores};

/// One prompt for the worker.
pub(super) struct Job {
    pub(super) ids: Vec<u32>,
    /// Seed of the prompt's sampling stream.
    pub(super) seed: u64,
    pub(super) params: SamplingParams,
    /// Top-k log-probs over prompt and output, when asked.
    pub(super) top_k: Option<usize>,
    /// The last layer's hidden states over prompt and output, when asked.
    pub(super) hidden: bool,
    pub(super) reply: oneshot::Sender<Result<JobResult>>,
}

pub(super) struct JobResult {
    pub(super) generation: Generation,
    /// Scores over prompt ++ generated ids (position t predicts token t + 1), with the last
    /// layer's hidden states when asked.
    pub(super) scores: Option<Scores>,
}

/// The worker: owns the teacher, batches jobs of equal sampling settings.
pub(super) fn worker(teacher: LocalTeacher, rx: mpsc::Receiver<Job>, wait: Duration) {
    let cap = teacher.batch_size();
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        let deadline = Instant::now() + wait;
        while jobs.len() < cap {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        // Groups of identical settings (the seed is per prompt).
        let mut groups: Vec<(SamplingParams, Vec<Job>)> = Vec::new();
        for job in jobs {
            if let Err(e) = teacher.check_ids(&job.ids, "the prompt") {
                let _ = job.reply.send(Err(e));
                continue;
            }
            let key = SamplingParams {
                seed: 0,
                ..job.params.clone()
            };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, g)) => g.push(job),
                None => groups.push((key, vec![job])),
            }
        }
        for (params, group) in groups {
            run_group(&teacher, &params, group);
        }
    }
}

fn run_group(teacher: &LocalTeacher, params: &SamplingParams, group: Vec<Job>) {
    let generated: Result<Vec<Generation>> = if params.max_new_tokens == 0 {
        Ok(group
            .iter()
            .map(|_| Generation::empty(params.return_logprobs))
            .collect())
    } else {
        let prompts: Vec<(&[u32], u64)> =
            group.iter().map(|j| (j.ids.as_slice(), j.seed)).collect();
        teacher.generate_seeded(&prompts, params)
    };
    let generated = match generated {
        Ok(g) => g,
        Err(e) => {
            let msg = e.to_string();
            for job in group {
                let _ = job.reply.send(Err(TeacherError::Input(msg.clone())));
            }
            return;
        }
    };
    // Scores over prompt ++ output, one batched pass per distinct (top-k, hidden states).
    let key = |j: &Job| (j.top_k.is_some() || j.hidden).then(|| (j.top_k.unwrap_or(1), j.hidden));
    let mut scores: Vec<Option<Result<Scores>>> = group.iter().map(|_| None).collect();
    let mut keys: Vec<(usize, bool)> = group.iter().filter_map(key).collect();
    keys.sort_unstable();
    keys.dedup();
    for (k, hidden) in keys {
        let members: Vec<usize> = (0..group.len())
            .filter(|i| key(&group[*i]) == Some((k, hidden)))
            .collect();
        let seqs: Vec<Vec<u32>> = members
            .iter()
            .map(|i| [group[*i].ids.as_slice(), &generated[*i].ids].concat())
            .collect();
        let options = ScoreOptions {
            top_k: k,
            hidden_layers: if hidden {
                vec![LAST_HIDDEN_LAYER]
            } else {
                Vec::new()
            },
        };
        match teacher.score_with(&seqs, &options) {
            Ok(s) => {
                for (i, s) in members.iter().zip(s) {
                    scores[*i] = Some(Ok(s));
                }
            }
            Err(e) => {
                let msg = e.to_string();
                for i in members {
                    scores[i] = Some(Err(TeacherError::Serve(msg.clone())));
                }
            }
        }
    }
    for ((job, generation), scores) in group.into_iter().zip(generated).zip(scores) {
        let reply = match scores.transpose() {
            Ok(scores) => Ok(JobResult { generation, scores }),
            Err(e) => Err(e),
        };
        let _ = job.reply.send(reply);
    }
}
