"""The ML side of echo-node: tokenizer, model, tasks/rewards, generation engines, GRPO, warm-up.

Dataflow: `tasks` samples prompt text → `tokenizer.encode_prompt` (adds bos) → an `engine.Engine`
generates version-tagged completions with behaviour log-probs → `rollout` scores them into
groups → `grpo.PolicyOptimizer.step` trains → `model.state_to_bytes` publishes the next version.
Nothing here does network I/O; `warmup` writes its cache file and `model` its checkpoints.
"""
