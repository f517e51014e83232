//! Every configuration key that ROLL's (github.com/alibaba/ROLL) distillation
//! pipeline accepts, one `const` per dataclass section, with ROLL's default value
//! in a trailing comment.
//!
//! Read from ROLL commit `8eb27cc2dc34c4d1310b169d9b86d339004d811a`:
//!
//! - `roll/pipeline/distill/distill_config.py`: `DistillConfig(BaseConfig)`
//! - `roll/configs/base_config.py`: `BaseConfig(ScheduleConfig)`, `ScheduleConfig`,
//!   `RouterArguments`, `RolloutMockConfig`, `TransferBackendArguments`
//! - `roll/configs/worker_config.py`: `WorkerConfig`, `StrategyArguments`,
//!   `SequencePackingConfig`, `RouterReplayConfig`
//! - `roll/configs/model_args.py`: `ModelArguments(LoraArguments)`
//! - `roll/configs/training_args.py`: `TrainingArguments` (a plain dataclass; it does
//!   not subclass Hugging Face `transformers.TrainingArguments`)
//! - `roll/configs/data_args.py`: `DataArguments`
//! - `roll/configs/generating_args.py`: `GeneratingArguments`
//! - `mcore_adapter/src/mcore_adapter/training_args.py`: `TrainingArguments(MegatronArguments,
//!   transformers.TrainingArguments)`. `strategy_config` for `megatron_train` / `megatron_infer`
//!   is merged into it (`roll/distributed/strategy/megatron_strategy.py`). The Hugging Face
//!   part is listed from `transformers==4.57.0` (`transformers/training_args.py`), the version
//!   pinned by ROLL's `requirements_torch280_vllm.txt`. Other requirement files pin other
//!   versions (4.51.x, 4.52.4, 5.2.0).
//!
//! `examples/start_distill_pipeline.py` builds the config with
//! `dacite.from_dict(DistillConfig, OmegaConf.to_container(cfg, resolve=True))` using dacite's
//! default `Config`, which is not strict. Unknown keys are dropped without an error; only
//! values of the wrong type are rejected. The YAML's `hydra:` block is consumed by Hydra's
//! `compose` and never reaches `DistillConfig`. A Hugging Face field named in a Megatron
//! `strategy_config` is passed as a constructor keyword, so an unknown key there does raise.
//!
//! Defaults use Python notation as written in ROLL (`None`, `True`, `{}` for
//! `default_factory=dict`, `Foo()` for a nested dataclass factory).
#![allow(dead_code)]

/// Top-level keys of a distill YAML: `DistillConfig` fields plus those it inherits from
/// `BaseConfig` and `ScheduleConfig`, in dataclass field order.
/// `max_running_requests` is declared in both parents and appears once.
/// After `__post_init__`, `DistillConfig` also has a `target_vocab_size` attribute, which is not a field
/// and is set from `tokenizer.vocab_size` by the pipeline.
#[rustfmt::skip]
pub(crate) const TOP_LEVEL: &[&str] = &[
    // --- roll/configs/base_config.py: ScheduleConfig (parent of BaseConfig) ---
    "generate_opt_level", // default: 1
    "is_num_return_sequences_expand", // default: False
    "max_running_requests", // default: 128
    "is_use_additional_prompts", // default: False
    "max_additional_running_prompts", // default: 16
    "user_defined_rollout_loop_cls", // default: "roll.distributed.scheduler.user_defined_rollout_loop.UserDefinedRolloutLoop"
    "router_args", // default: None (see ROUTER_ARGS)
    // --- roll/configs/base_config.py: BaseConfig ---
    "exp_name", // default: os.path.basename(sys.argv[0])[:-len(".py")] (launcher script file name without ".py", e.g. "start_distill_pipeline")
    "seed", // default: 42
    "rpc_timeout", // default: 3600
    "output_dir", // default: "./output"
    "base_dir", // default: "./output"
    "logging_dir", // default: "./output/logs"
    "rollout_dump_dir", // default: None
    "track_with", // default: "tensorboard"
    "tracker_kwargs", // default: {}
    "max_steps", // default: 500 (not updated by DistillConfig.set_max_steps)
    "save_steps", // default: 50
    "max_ckpt_to_keep", // default: 0
    "logging_steps", // default: 1
    "eval_steps", // default: 10
    "rollout_batch_size", // default: 128
    "val_batch_size", // default: 128
    "local_rank", // default: -1
    "resume_from_checkpoint", // default: False
    "checkpoint_config", // default: {} (free-form dict, see CHECKPOINT_CONFIG)
    "prompt_length", // default: 1024
    "response_length", // default: None
    "sequence_length", // default: None (BaseConfig.__post_init__ asserts response_length or sequence_length is set)
    "val_prompt_length", // default: None
    "val_sequence_length", // default: None
    "profiler_timeline", // default: False
    "profiler_memory", // default: False
    "report_length_and_rewards", // default: False
    "is_offload_states", // default: False
    "is_offload_optimizer_states_in_train_step", // default: False
    "length_profiler_dir", // default: "./output/profiler"
    "profiler_output_dir", // default: "./output/profiler"
    "otlp_output_dir", // default: "./output/otlp"
    "system_envs", // default: {}
    "model_update_buffer_size_mb", // default: 1024
    "num_nodes", // default: 1
    "num_gpus_per_node", // default: 8 (overwritten in __post_init__ by current_platform.device_count())
    "model_download_type", // default: None
    "rollout_mock", // default: None (see ROLLOUT_MOCK)
    "transfer_backend", // default: None (see TRANSFER_BACKEND)
    // --- roll/pipeline/distill/distill_config.py: DistillConfig ---
    "student_pretrain", // default: None (copied into student.model_args.model_name_or_path, see DistillConfig.__post_init__)
    "teacher_pretrain", // default: None (copied into teacher.model_args.model_name_or_path, see DistillConfig.__post_init__)
    "student", // default: WorkerConfig() (see WORKER)
    "teacher", // default: WorkerConfig() (see WORKER)
    "validation", // default: None (WorkerConfig or None; only validation.data_args.file_name is read)
    "question_key", // default: "question"
    "answer_key", // default: "answer"
    "logits_topk", // default: 64
    "distill_loss_weight", // default: 0.5
    "kd_temperature", // default: 1
    "teacher_temperature", // default: 1
    "kd_objective", // default: "forward_kl"
    "adaptive_kl_alpha", // default: 0.5
    "skew_lambda", // default: 0.1
    "distill_on_prompt", // default: False
    "max_grad_norm", // default: 0 (declared by DistillConfig, not BaseConfig; passed to Megatron as clip_grad)
    "logits_transfer_backend", // default: "ipc+nccl"
];

/// Keys accepted under `student:`, `teacher:` and `validation:` (`WorkerConfig`).
/// `checkpoint_config`, `resource_placement_groups` and `is_configured` are set in `__post_init__`
/// and are not fields. A `checkpoint_config` written under a worker is dropped; the top-level one is copied in.
#[rustfmt::skip]
pub(crate) const WORKER: &[&str] = &[
    // --- roll/configs/worker_config.py: WorkerConfig ---
    "name", // default: None (DistillConfig forces "student" / "teacher")
    "worker_cls", // default: None (DistillConfig sets roll.pipeline.distill.distill_worker.StudentWorker / TeacherWorker)
    "pg_variant", // default: None
    "model_args", // default: ModelArguments() (see MODEL_ARGS)
    "training_args", // default: TrainingArguments() (see TRAINING_ARGS)
    "data_args", // default: None (see DATA_ARGS)
    "generating_args", // default: None (see GENERATING_ARGS)
    "strategy_args", // default: None (see STRATEGY_ARGS)
    "world_size", // default: None (derived: len(device_mapping) // num_gpus_per_worker)
    "device_mapping", // default: None (string eval()-ed in __post_init__, e.g. "list(range(0,8))")
    "num_gpus_per_worker", // default: 1
    "model_update_frequency", // default: 1
    "infer_batch_size", // default: 16
    "backend_timeout", // default: 30
    "system_envs", // default: {}
    "topr_positive_weight", // default: 1.0
    "topr_negative_weight", // default: 1.0
    "max_concurrency", // default: 1
    "use_dynamic_batching_in_train", // default: False
    "max_tokens_per_microbatch_in_train", // default: 0
    "sequence_length_round_in_train", // default: 4
    "use_dynamic_batching_in_infer", // default: False
    "max_tokens_per_microbatch_in_infer", // default: None
    "sequence_length_round_in_infer", // default: 4
    "offload_nccl", // default: False (forced to False in __post_init__)
    "use_sequence_packing", // default: False
    "sequence_packing_args", // default: SequencePackingConfig() (see SEQUENCE_PACKING_ARGS)
    "logits_in_fp32", // default: False
    "router_replay", // default: RouterReplayConfig() (see ROUTER_REPLAY)
    "apply_loss_scale", // default: True
    "mtp_training_mode", // default: "disabled"
    "opd_kl_coef", // default: None
    "tag_included", // default: []
];

/// Keys under `<worker>.model_args` (`ModelArguments`, including its `LoraArguments` parent).
#[rustfmt::skip]
pub(crate) const MODEL_ARGS: &[&str] = &[
    // --- roll/configs/model_args.py: LoraArguments (parent) ---
    "additional_target", // default: None (comma string split into a list)
    "autocast_adapter_dtype", // default: True
    "lora_alpha", // default: None (__post_init__: lora_alpha or lora_rank * 2, i.e. 16)
    "lora_dropout", // default: 0.0
    "lora_rank", // default: 8
    "lora_target", // default: None (comma string split into a list unless it contains * $ | ( ; "all-linear"/"all-embedding"/"all-router" expanded)
    // --- roll/configs/model_args.py: ModelArguments ---
    "model_name_or_path", // default: None (filled from student_pretrain / teacher_pretrain)
    "adapter_name_or_path", // default: None
    "attn_implementation", // default: None ("fa2" rewritten to "flash_attention_2")
    "moe_aux_loss_coef", // default: None
    "disable_gradient_checkpointing", // default: False
    "gradient_checkpointing_use_reentrant", // default: None
    "device_map", // default: "balanced"
    "dtype", // default: "bf16" ("bf16"/"fp16" also sets training_args.bf16/fp16 = true)
    "model_type", // default: None
    "num_labels", // default: 1
    "model_config_kwargs", // default: {}
    "freeze_module_prefix", // default: None (comma string split into a list)
    "ulysses_size", // default: 1
];

/// Keys under `<worker>.training_args`. ROLL's own `TrainingArguments` is a plain dataclass
/// that does not inherit from `transformers`, so these 19 keys are the whole list.
/// For Megatron strategies every one of them is also passed on to `mcore_adapter.TrainingArguments`.
#[rustfmt::skip]
pub(crate) const TRAINING_ARGS: &[&str] = &[
    // --- roll/configs/training_args.py: TrainingArguments ---
    "output_dir", // default: "" (DistillConfig overwrites with top-level output_dir)
    "max_steps", // default: -1 (DistillConfig.set_max_steps: epochs*len(dataset)//(bs*GA), Megatron divides by dp)
    "num_train_epochs", // default: 1.0 (used as range(num_train_epochs): must be an integer in practice)
    "learning_rate", // default: 5e-05
    "lr_scheduler_type", // default: "linear"
    "weight_decay", // default: 0.0
    "adam_beta1", // default: 0.9
    "adam_beta2", // default: 0.999
    "per_device_train_batch_size", // default: 8
    "gradient_accumulation_steps", // default: 1
    "seed", // default: 42 (BaseConfig overwrites with top-level seed)
    "data_seed", // default: None
    "dataloader_num_workers", // default: 0
    "fp16", // default: False
    "bf16", // default: False
    "tf32", // default: None
    "warmup_ratio", // default: 0.0
    "warmup_steps", // default: 0
    "save_hf_model", // default: False
];

/// Keys under `<worker>.data_args` (`DataArguments`). The distill pipeline reads only `file_name`,
/// `template` and `preprocessing_num_workers` from `student.data_args`, and only `file_name` from
/// `validation.data_args`.
#[rustfmt::skip]
pub(crate) const DATA_ARGS: &[&str] = &[
    // --- roll/configs/data_args.py: DataArguments ---
    "template", // default: "native"
    "domain_interleave_probs", // default: None
    "preprocessing_num_workers", // default: None
    "file_name", // default: None
    "eval_file_name", // default: None
    "dataset_type", // default: "json"
    "tag", // default: "tag"
    "id", // default: "id"
    "prompt", // default: None
    "response", // default: "solution"
    "messages", // default: None
    "image_max_pixels", // default: 4096 * 4096
    "image_min_pixels", // default: 4 * 28 * 28
    "video_max_pixels", // default: 2048 * 2048
    "video_min_pixels", // default: 4 * 28 * 28
    "video_total_pixels", // default: 16384 * 28 * 28
    "video_fps", // default: 2.0
    "video_max_frames", // default: 128
    "video_resize_chunk_frames", // default: 64
    "image_folder", // default: None
    "video_folder", // default: None
    "audio_folder", // default: None
    "custom_data_kwargs_func", // default: None
];

/// Keys under `<worker>.strategy_args` (`StrategyArguments`). `strategy_name` is one of
/// `hf_infer`, `vllm`, `sglang`, `megatron_infer`, `megatron_train`, `fsdp2_train`, `fsdp2_infer`.
#[rustfmt::skip]
pub(crate) const STRATEGY_ARGS: &[&str] = &[
    // --- roll/configs/worker_config.py: StrategyArguments ---
    "strategy_name", // default: "fsdp2_train"
    "strategy_config", // default: {} (free-form dict; for megatron_* see MEGATRON_STRATEGY_CONFIG)
];

/// Keys under `<worker>.generating_args` (`GeneratingArguments`). The field defaults to `None`,
/// and the distill pipeline never uses it.
#[rustfmt::skip]
pub(crate) const GENERATING_ARGS: &[&str] = &[
    // --- roll/configs/generating_args.py: GeneratingArguments ---
    "do_sample", // default: True
    "temperature", // default: 0.95
    "top_p", // default: 0.7
    "top_k", // default: 50
    "num_beams", // default: 1
    "max_length", // default: 8192
    "max_new_tokens", // default: 8192
    "repetition_penalty", // default: 1.0
    "length_penalty", // default: 1.0
    "num_return_sequences", // default: 1
    "stop_strings", // default: None
    "include_stop_str_in_output", // default: None
    "logprobs", // default: 0
];

/// Keys under `<worker>.sequence_packing_args` (`SequencePackingConfig`).
#[rustfmt::skip]
pub(crate) const SEQUENCE_PACKING_ARGS: &[&str] = &[
    // --- roll/configs/worker_config.py: SequencePackingConfig ---
    "algorithm", // default: "none"
    "max_packed_sequence_length_forward", // default: None
    "max_packed_sequence_length_train", // default: None
    "min_num_micro_batches_forward", // default: 1
    "min_num_micro_batches_train", // default: 1
];

/// Keys under `<worker>.router_replay` (`RouterReplayConfig`). `"R2"` raises `NotImplementedError`.
#[rustfmt::skip]
pub(crate) const ROUTER_REPLAY: &[&str] = &[
    // --- roll/configs/worker_config.py: RouterReplayConfig ---
    "mode", // default: "disable"
];

/// Keys under top-level `router_args` (`RouterArguments`, inherited from `ScheduleConfig`). Not used by distillation.
#[rustfmt::skip]
pub(crate) const ROUTER_ARGS: &[&str] = &[
    // --- roll/configs/base_config.py: RouterArguments ---
    "router_name", // default: None
    "router_config", // default: {}
    "max_running_requests", // default: 128
];

/// Keys under top-level `rollout_mock` (`RolloutMockConfig`). Not used by distillation.
#[rustfmt::skip]
pub(crate) const ROLLOUT_MOCK: &[&str] = &[
    // --- roll/configs/base_config.py: RolloutMockConfig ---
    "enable", // default: False
    "mode", // default: "dump"
    "dump_dir", // default: "./rollout_mock_dumps"
];

/// Keys under top-level `transfer_backend` (`TransferBackendArguments`), passed to
/// `init_transfer_backend` in `roll/pipeline/base_pipeline.py`.
#[rustfmt::skip]
pub(crate) const TRANSFER_BACKEND: &[&str] = &[
    // --- roll/configs/base_config.py: TransferBackendArguments ---
    "backend_name", // default: None
    "backend_config", // default: {}
];

/// Keys of top-level `checkpoint_config`. It is an untyped `Dict`, not a dataclass. These are the keys
/// that ROLL code reads (`roll/configs/base_config.py`, `roll/pipeline/base_pipeline.py`,
/// `roll/utils/checkpoint_manager.py`, `roll/utils/upload_utils.py`). Every key other than `type`
/// is also passed as a keyword argument to the uploader constructor, which ignores extras.
#[rustfmt::skip]
pub(crate) const CHECKPOINT_CONFIG: &[&str] = &[
    // --- untyped dict: keys read by ROLL ---
    "type", // default: None (no uploader; "file_system" is the only registered type, roll/utils/upload_utils.py)
    "output_dir", // default: None (required by FileSystemUploader; BaseConfig appends a "/%Y%m%d-%H%M%S" timestamp when type == "file_system")
    "async_upload", // default: True (read with .get("async_upload", True); forced False when resume_from_checkpoint is True)
];

/// Keys that `<worker>.strategy_args.strategy_config` accepts when `strategy_name` is `megatron_train`
/// or `megatron_infer`. ROLL builds `mcore_adapter.TrainingArguments(**config_dict)`, where `config_dict` is
/// `training_args.to_dict()` updated with `strategy_config` and then with `{"max_grad_norm": <top-level>}`
/// (`roll/distributed/strategy/megatron_strategy.py`). That class inherits `MegatronArguments` and
/// Hugging Face's `TrainingArguments` (listed here from transformers 4.57.0, without the `init=False`
/// field `_n_gpu`). A key outside this list raises `TypeError`. `fsdp2_*` strategies read `strategy_config`
/// differently and are not covered here.
#[rustfmt::skip]
pub(crate) const MEGATRON_STRATEGY_CONFIG: &[&str] = &[
    // --- mcore_adapter/src/mcore_adapter/training_args.py: DistributingParallelArguments ---
    "tensor_model_parallel_size", // default: None
    "pipeline_model_parallel_size", // default: None
    "sequence_parallel", // default: False
    "virtual_pipeline_model_parallel_size", // default: None
    "context_parallel_size", // default: None
    "expert_model_parallel_size", // default: None
    "expert_tensor_parallel_size", // default: None
    "account_for_embedding_in_pipeline_split", // default: None
    "account_for_loss_in_pipeline_split", // default: None
    "pipeline_model_parallel_layout", // default: None
    "overlap_p2p_comm", // default: True
    "variable_seq_lengths", // default: False
    "recompute_granularity", // default: None
    "recompute_method", // default: None
    "recompute_modules", // default: None
    "recompute_num_layers", // default: None
    "bias_activation_fusion", // default: False
    "apply_rope_fusion", // default: False
    "cross_entropy_loss_fusion", // default: False
    "moe_layer_recompute", // default: False
    "moe_token_dispatcher_type", // default: "allgather"
    "moe_aux_loss_coeff", // default: None
    "moe_grouped_gemm", // default: None
    "moe_expert_capacity_factor", // default: None
    "moe_pad_expert_input_to_capacity", // default: None
    "moe_token_drop_policy", // default: None
    "moe_shared_expert_overlap", // default: False
    "moe_enable_routing_replay", // default: False
    "moe_router_dtype", // default: None
    "mtp_num_layers", // default: 0
    "calculate_per_token_loss", // default: False
    "transformer_impl", // default: None
    "cuda_graph_impl", // default: None
    "cuda_graph_scope", // default: "full"
    "fp8_recipe", // default: None
    "fp8_param", // default: False
    "fp8", // default: None
    "additional_configs", // default: {}
    // --- mcore_adapter/src/mcore_adapter/training_args.py: MegatronArguments ---
    "accumulate_allreduce_grads_in_fp32", // default: False
    "use_distributed_optimizer", // default: False
    "distrib_optim_fully_reshardable", // default: False
    "distrib_optim_fully_reshardable_mem_efficient", // default: False
    "overlap_grad_reduce", // default: False
    "delay_grad_reduce", // default: True
    "overlap_param_gather", // default: False
    "check_for_nan_in_loss_and_grad", // default: True
    "ddp_average_in_collective", // default: False
    "ddp_bucket_size", // default: None
    "optimizer", // default: "adam"
    "optimizer_cpu_offload", // default: False
    "optimizer_offload_fraction", // default: 0.0
    "save_hf_model", // default: False
    "save_merged_model", // default: False
    "ckpt_format", // default: "legacy"
    "ckpt_d2h_non_blocking", // default: False
    "sequence_packing", // default: False
    "compile_warmup", // default: False
    // --- transformers==4.57.0 transformers/training_args.py: TrainingArguments (inherited) ---
    "output_dir", // default: None
    "overwrite_output_dir", // default: False
    "do_train", // default: False
    "do_eval", // default: False
    "do_predict", // default: False
    "eval_strategy", // default: "no"
    "prediction_loss_only", // default: False
    "per_device_train_batch_size", // default: 8
    "per_device_eval_batch_size", // default: 8
    "per_gpu_train_batch_size", // default: None
    "per_gpu_eval_batch_size", // default: None
    "gradient_accumulation_steps", // default: 1
    "eval_accumulation_steps", // default: None
    "eval_delay", // default: 0
    "torch_empty_cache_steps", // default: None
    "learning_rate", // default: 5e-05
    "weight_decay", // default: 0.0
    "adam_beta1", // default: 0.9
    "adam_beta2", // default: 0.999
    "adam_epsilon", // default: 1e-08
    "max_grad_norm", // default: 1.0 (always overwritten with top-level max_grad_norm)
    "num_train_epochs", // default: 3.0
    "max_steps", // default: -1
    "lr_scheduler_type", // default: "linear"
    "lr_scheduler_kwargs", // default: {} (setdefault({}) by MegatronInferStrategy)
    "warmup_ratio", // default: 0.0
    "warmup_steps", // default: 0
    "log_level", // default: "passive"
    "log_level_replica", // default: "warning"
    "log_on_each_node", // default: True
    "logging_dir", // default: None
    "logging_strategy", // default: "steps"
    "logging_first_step", // default: False
    "logging_steps", // default: 500
    "logging_nan_inf_filter", // default: True
    "save_strategy", // default: "steps"
    "save_steps", // default: 500
    "save_total_limit", // default: None
    "save_safetensors", // default: True
    "save_on_each_node", // default: False
    "save_only_model", // default: False
    "restore_callback_states_from_checkpoint", // default: False
    "no_cuda", // default: False
    "use_cpu", // default: False
    "use_mps_device", // default: False
    "seed", // default: 42
    "data_seed", // default: None
    "jit_mode_eval", // default: False
    "bf16", // default: False
    "fp16", // default: False
    "fp16_opt_level", // default: "O1"
    "half_precision_backend", // default: "auto"
    "bf16_full_eval", // default: False
    "fp16_full_eval", // default: False
    "tf32", // default: None
    "local_rank", // default: -1
    "ddp_backend", // default: None
    "tpu_num_cores", // default: None
    "tpu_metrics_debug", // default: False
    "debug", // default: ""
    "dataloader_drop_last", // default: False
    "eval_steps", // default: None
    "dataloader_num_workers", // default: 0
    "dataloader_prefetch_factor", // default: None
    "past_index", // default: -1
    "run_name", // default: None
    "disable_tqdm", // default: None
    "remove_unused_columns", // default: True
    "label_names", // default: None
    "load_best_model_at_end", // default: False
    "metric_for_best_model", // default: None
    "greater_is_better", // default: None
    "ignore_data_skip", // default: False
    "fsdp", // default: []
    "fsdp_min_num_params", // default: 0
    "fsdp_config", // default: None
    "fsdp_transformer_layer_cls_to_wrap", // default: None
    "accelerator_config", // default: None
    "parallelism_config", // default: None
    "deepspeed", // default: None
    "label_smoothing_factor", // default: 0.0
    "optim", // default: "adamw_torch_fused" if torch >= 2.8 else "adamw_torch"
    "optim_args", // default: None
    "adafactor", // default: False
    "group_by_length", // default: False
    "length_column_name", // default: "length"
    "report_to", // default: None
    "project", // default: "huggingface"
    "trackio_space_id", // default: "trackio"
    "ddp_find_unused_parameters", // default: None
    "ddp_bucket_cap_mb", // default: None
    "ddp_broadcast_buffers", // default: None
    "dataloader_pin_memory", // default: True
    "dataloader_persistent_workers", // default: False
    "skip_memory_metrics", // default: True
    "use_legacy_prediction_loop", // default: False
    "push_to_hub", // default: False
    "resume_from_checkpoint", // default: None
    "hub_model_id", // default: None
    "hub_strategy", // default: "every_save"
    "hub_token", // default: None
    "hub_private_repo", // default: None
    "hub_always_push", // default: False
    "hub_revision", // default: None
    "gradient_checkpointing", // default: False
    "gradient_checkpointing_kwargs", // default: None
    "include_inputs_for_metrics", // default: False
    "include_for_metrics", // default: []
    "eval_do_concat_batches", // default: True
    "fp16_backend", // default: "auto"
    "push_to_hub_model_id", // default: None
    "push_to_hub_organization", // default: None
    "push_to_hub_token", // default: None
    "mp_parameters", // default: ""
    "auto_find_batch_size", // default: False
    "full_determinism", // default: False
    "torchdynamo", // default: None
    "ray_scope", // default: "last"
    "ddp_timeout", // default: 1800
    "torch_compile", // default: False
    "torch_compile_backend", // default: None
    "torch_compile_mode", // default: None
    "include_tokens_per_second", // default: False
    "include_num_input_tokens_seen", // default: False
    "neftune_noise_alpha", // default: None
    "optim_target_modules", // default: None
    "batch_eval_metrics", // default: False
    "eval_on_start", // default: False
    "use_liger_kernel", // default: False
    "liger_kernel_config", // default: None
    "eval_use_gather_object", // default: False
    "average_tokens_across_devices", // default: True
];
