"""TRL 1.16's GRPOTrainer on vlmtrain's Trainer, for causal language models: a TRL GRPO script runs with only its
import changed. Each generation batch (``per_device_train_batch_size x steps_per_generation`` rows, each prompt
``num_generations`` times: grpo_rollout.GroupSampler) is rolled out by the :class:`~.grpo_rollout.Generator`,
scored by the reward functions, turned into group-relative advantages and buffered; the micro-steps of the next
``steps_per_generation x num_iterations`` take their slices of it. The objective (models/objectives/grpo.py) returns
the loss with TRL's metrics; the rollout's metrics (``reward``, ``completions/mean_length``, ...) join the logs."""

from __future__ import annotations

import copy
import warnings
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from ..data.preference_vision import is_vision_pairs
from ..errors import ConfigError
from ..models.objectives import disable_dropout
from ..models.objectives.grpo import GRPOObjective, group_advantages, nanstd, vision_inputs
from .dpo import _enable_dummy_vision, _load_model, _load_processing_class
from .dpo_reference import PolicyObjectiveTrainer
from .grpo_config import GRPOConfig
from .grpo_eval import GRPOEvaluation, check_eval_batch, check_eval_dataset
from .grpo_rollout import (
    Generator,
    GroupSampler,
    HFGenerate,
    pad_rows,
    prompt_token_ids,
    resolve_reward_funcs,
    score,
)
from .grpo_state import RolloutCheckpoints
from .grpo_stream import is_stream, stream_loader, streamed_prompts
from .grpo_table import completions_table
from .grpo_video import check_video_support, has_videos, video_support
from .grpo_vision import (
    VisionGenerate,
    check_vision_dataset,
    check_vision_model,
    encode_groups,
    rows_of,
)


def _rows(samples: list[dict]) -> dict[str, list[dict]]:
    return {"rows": samples}  # (a generation batch stays its dataset rows: the rollout processes them)


class GRPOTrainer(RolloutCheckpoints, GRPOEvaluation, PolicyObjectiveTrainer):
    """TRL's GRPOTrainer for a causal language model (an object or a path) and its tokenizer, or a Hub VLM family's
    model and its processor (prompts with images, each group's encoded once: grpo_vision.py): ``reward_funcs``
    (callables or ``module:function`` strings, weighted by ``args.reward_weights``) score the completions of a
    dataset with a ``prompt`` column (text, or conversational messages); its other columns reach the functions as
    keyword arguments. ``generator``: the rollout engine (default: the policy's ``generate``). The reference: none
    with ``beta`` 0, else the policy with its adapters off (a peft model, or ``peft_config``), else a frozen copy.
    ``self.model`` is the :class:`GRPOObjective`; ``self.policy`` the model trained; ``self.video_support``: the
    family's video support for prompts with videos (grpo_video.py; a run config sets its ``data.video_*``)."""

    def __init__(self, model: str | nn.Module, reward_funcs: Any, args: GRPOConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 reward_processing_classes: Any = None, callbacks: list | None = None,
                 optimizers: tuple = (None, None), peft_config: Any = None, generator: Generator | None = None,
                 **trl_only: Any) -> None:
        from transformers import AutoTokenizer, GenerationConfig, set_seed

        if trl_only:
            raise ConfigError(f"GRPOTrainer: {', '.join(sorted(trl_only))} not supported by vlmtrain's GRPO yet.")
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GRPOConfig(f"{str(name).split('/')[-1]}-GRPO")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        train_dataset = streamed_prompts(train_dataset, args.max_steps)  # (a stream: read whole by each process)
        if eval_dataset is not None:  # (evaluated as TRL evaluates: compat/grpo_eval.py)
            check_eval_batch(args)
            check_eval_dataset(eval_dataset)
        first = next(iter(train_dataset))
        if "prompt" not in first:
            raise ConfigError(f"GRPO's dataset needs a 'prompt' column (its columns: {sorted(first)}).")
        vision = is_vision_pairs(first)  # (TRL's rule: an images / image column; or videos: grpo_video.py)
        if vision:  # (before the model loads)
            check_vision_dataset(first)
            check_video_support(first, model)
        self.reward_funcs, self.reward_func_names = resolve_reward_funcs(  # (reward models: on this process's device)
            reward_funcs, processing_classes=reward_processing_classes, init_kwargs=args.model_init_kwargs,
            device=args.device, batch_size=args.per_device_train_batch_size)
        weights = args.reward_weights or [1.0] * len(self.reward_funcs)
        if len(weights) != len(self.reward_funcs):
            raise ConfigError(f"reward_weights has {len(weights)} values for {len(self.reward_funcs)} reward "
                              "functions: give one per function.")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        set_seed(args.seed)
        if isinstance(model, str):
            model = _load_model(model, args.model_init_kwargs or {})
        if processing_class is None:
            processing_class = (_load_processing_class(model) if vision
                                else AutoTokenizer.from_pretrained(model.config._name_or_path))
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        self._image_token_id = self.video_support = None  # (images / videos: each group's processed once)
        if vision:
            self._image_layout = check_vision_model(model).batch_layout
            if getattr(processing_class, "image_processor", None) is None:
                raise ConfigError("the dataset's prompts have images ('images' or 'image' column) but "
                                  "processing_class is a tokenizer: pass the vision-language model's processor.")
            self._image_token_id = model.config.image_token_id
            self.video_support = video_support(model, processing_class) if has_videos(first) else None
            _enable_dummy_vision(model)  # (several processes: a micro-batch without images runs the dummy image)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.tokenizer = tokenizer
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        ref_model = None
        if args.beta != 0.0 and not hasattr(model, "disable_adapter"):
            ref_model = copy.deepcopy(model)
        if args.disable_dropout:
            disable_dropout(model, ref_model)
        objective = GRPOObjective(model, ref_model, beta=args.beta, epsilon=args.epsilon,
                                  epsilon_high=args.epsilon_high, loss_type=args.loss_type,
                                  importance_sampling_level=args.importance_sampling_level,
                                  max_completion_length=args.max_completion_length, temperature=args.temperature,
                                  use_bias_correction_kl=args.use_bias_correction_kl)
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else (
            tokenizer.eos_token_id)
        self.eos_token_ids = eos if isinstance(eos, list) else [eos]
        if generator is None:
            options = dict(max_new_tokens=args.max_completion_length, do_sample=True,
                           pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=self.eos_token_ids, temperature=args.temperature, top_p=args.top_p,
                           top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty)
            if vision:  # (as TRL: a sampled image token would mismatch the image features)
                options["suppress_tokens"] = [self._image_token_id] + (
                    [model.config.video_token_id] if self.video_support is not None else [])
            config = GenerationConfig(**{**options, **(args.generation_kwargs or {})})
            generator = (VisionGenerate if vision else HFGenerate)(config, tokenizer.pad_token_id, self.eos_token_ids)
        self.generator = generator
        self._buffer: list[dict] | None = None
        self._micro = 0
        self._rollout_metrics: dict[str, list[float]] = defaultdict(list)
        self._eval_rollout_metrics: dict[str, list[float]] = defaultdict(list)
        self._skipped: dict[str, int] = {}
        self._table: list[dict] = []
        super().__init__(model=objective, args=args, data_collator=_rows, train_dataset=train_dataset,
                         eval_dataset=eval_dataset,
                         processing_class=processing_class, callbacks=callbacks, optimizers=optimizers)

    def get_train_dataloader(self) -> StatefulDataLoader:
        """Generation batches in TRL's order (grpo_rollout.GroupSampler), each a list of dataset rows."""
        args = self.args
        if is_stream(self.train_dataset):  # (TRL's order over a stream: grpo_stream.GroupStream)
            return stream_loader(self)
        sampler = GroupSampler(len(self.train_dataset), args.num_generations,
                               args.generation_batch_size // args.num_generations,
                               args.num_iterations * args.steps_per_generation, args.shuffle_dataset, args.seed,
                               self.rank, self.world_size)
        return StatefulDataLoader(self.train_dataset, batch_size=args.per_device_train_batch_size
                                  * args.steps_per_generation, sampler=sampler, collate_fn=_rows,
                                  generator=torch.Generator().manual_seed(args.seed))  # (not torch's RNG: sampling's)

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-step on this step's slice of the buffered generation batch, rolled out first where the
        buffer is spent (every ``steps_per_generation x num_iterations`` micro-steps)."""
        args = self.args
        model.train()  # (before the rollout, as transformers' training_step: an evaluation left it in eval mode)
        if self._micro % (args.steps_per_generation * args.num_iterations) == 0 or self._buffer is None:
            self._buffer = self._split(self._generate_and_score(inputs["rows"]), args.steps_per_generation)
        batch = self._buffer[self._micro % args.steps_per_generation]
        self._micro += 1
        # (the loader's batch is dataset rows: the window's samples and tokens are the completions trained on)
        self._throughput.add_batch({k: batch[k] for k in ("input_ids", "attention_mask")}, 0.0)
        return super().training_step(model, batch, num_items_in_batch)

    @staticmethod
    def _split(batch: dict[str, Any], chunks: int) -> list[dict[str, torch.Tensor]]:
        size = len(batch["advantages"]) // chunks
        return [rows_of(batch, i * size, (i + 1) * size) for i in range(chunks)]

    @torch.no_grad()
    def _generate_and_score(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        args, device, policy = self.args, self.device, self.model.policy
        prompts = [r["prompt"] for r in rows]
        groups = None
        if self._image_token_id is not None:  # (each group's prompt and images processed once)
            groups = encode_groups(self.processing_class, rows, self._image_token_id, self._image_layout,
                                   video=self.video_support)
            prompt_ids = groups.row_prompt_ids()
        else:
            prompt_ids = prompt_token_ids(self.tokenizer, rows)
        positions = getattr(policy.config.get_text_config(), "max_position_embeddings", None)
        longest = max(len(p) for p in prompt_ids)
        if positions is not None and longest + args.max_completion_length > positions:
            raise ConfigError(f"a prompt of {longest} tokens leaves no room for max_completion_length="
                              f"{args.max_completion_length} within the model's {positions} positions: shorten "
                              "the prompts or lower max_completion_length.")
        completion_ids = self.generator(policy, prompt_ids, **({} if groups is None else {"vision": groups}))
        conversational = isinstance(prompts[0], list)
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
        columns = {k: [r[k] for r in rows] for k in rows[0] if k not in ("prompt", "prompt_ids", "completion", "completion_ids")}
        per_func = score(self.reward_funcs, self.reward_func_names, prompts, completions, completion_ids, columns,
                         self._skipped, trainer_state=self.state)
        per_func = self._gather(per_func)  # (every process's: a group, or the batch, may span processes; as TRL)
        unscorable = torch.isnan(per_func).all(dim=1)
        rewards = (per_func * self.reward_weights).nansum(dim=1)
        rewards[unscorable] = float("nan")
        advantages, std_zero = group_advantages(rewards, args.num_generations, args.scale_rewards)
        mine = self._own_rows(len(rows))
        p_ids, p_mask = pad_rows(prompt_ids, self.tokenizer.pad_token_id, "left", device)
        c_ids, c_mask = pad_rows(completion_ids, self.tokenizer.pad_token_id, "right", device)
        ends = set(self.eos_token_ids) | {self.tokenizer.pad_token_id}
        truncated = torch.tensor([not c or c[-1] not in ends for c in completion_ids], device=device)
        if args.mask_truncated_completions:
            c_mask = c_mask * (~truncated).unsqueeze(1).long()
        batch = {"input_ids": torch.cat([p_ids, c_ids], 1), "attention_mask": torch.cat([p_mask, c_mask], 1),
                 "completion_mask": c_mask, "advantages": advantages[mine].to(device)}
        if args.loss_type == "dapo" and args.steps_per_generation != args.gradient_accumulation_steps:
            # (TRL's normalizer: the generation batch's completion tokens, every process's, one micro-step's share of
            # them. Where a window is the whole generation batch, its own tokens are those: the metrics then stay
            # weighted by each micro-batch's tokens, as one process weighs them)
            total = self._gather(c_mask.sum().float().reshape(1)).sum().clamp(min=1.0)
            share = total / (args.steps_per_generation * self.world_size)
            batch["dapo_normalizer"] = share.expand(len(rows)).to(device)
        if groups is not None:
            batch.update({k: v.to(device) for k, v in groups.token_rows(p_ids.shape[1], c_ids.shape[1]).items()})
            batch["vision"] = groups
        generate_every = args.steps_per_generation * args.num_iterations
        objective = self.model
        if args.gradient_accumulation_steps % generate_every != 0:  # (as TRL: the policy moves before use)
            batch["old_per_token_logps"] = self._chunked(objective.policy_logps, batch, c_ids)
        if args.beta != 0.0:
            batch["ref_per_token_logps"] = self._chunked(objective.reference_logps, batch, c_ids)
        lengths = self._gather(torch.tensor([float(len(c)) for c in completion_ids]))
        self._log_rollout(per_func, rewards, std_zero, lengths, self._gather(truncated.float()).bool(), prompts,
                          completions, advantages)
        return batch

    def _chunked(self, fn: Any, batch: dict[str, Any], completion_ids: torch.Tensor) -> torch.Tensor:
        size, out = self.args.per_device_train_batch_size, []
        for i in range(0, len(completion_ids), size):
            rows = rows_of(batch, i, i + size)
            out.append(fn(rows["input_ids"], rows["attention_mask"], completion_ids[i:i + size],
                          **vision_inputs(rows)))
        return torch.cat(out)

    def _log_rollout(self, per_func: torch.Tensor, rewards: torch.Tensor, std_zero: torch.Tensor,
                     lengths: torch.Tensor, truncated: torch.Tensor, prompts: list, completions: list,
                     advantages: torch.Tensor) -> None:
        """TRL's rollout metrics of the whole generation batch (every process's rows), averaged over a logging
        window in :meth:`log` (an evaluation's into its own window); with log_completions, the completions table
        of the whole generation batch (grpo_table.py)."""
        m = self._rollout_metrics if self.model.training else self._eval_rollout_metrics
        m["completions/mean_length"].append(lengths.mean().item())
        m["completions/min_length"].append(lengths.min().item())
        m["completions/max_length"].append(lengths.max().item())
        m["completions/clipped_ratio"].append(truncated.float().mean().item())
        ended = lengths[~truncated]
        ended = ended if len(ended) else torch.zeros(1)
        m["completions/mean_terminated_length"].append(ended.mean().item())
        m["completions/min_terminated_length"].append(ended.min().item())
        m["completions/max_terminated_length"].append(ended.max().item())
        for i, name in enumerate(self.reward_func_names):
            m[f"rewards/{name}/mean"].append(torch.nanmean(per_func[:, i]).item())
            m[f"rewards/{name}/std"].append(nanstd(per_func[:, i]).item())
        m["reward"].append(torch.nanmean(rewards).item())
        m["reward_std"].append(nanstd(rewards).item())
        m["frac_reward_zero_std"].append(std_zero.float().mean().item())
        if self.args.log_completions and self.model.training:
            self._table = completions_table(prompts, completions, per_func, self.reward_func_names, rewards,
                                            advantages, self.args.num_completions_to_print,
                                            f"{self.args.seed}-{self.state.global_step}",
                                            self.args.log_unique_prompts)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer.log with the rollout metrics of the window (and skipped reward calls, per function); with
        log_completions, ``completions``: a sample of the last generation's table (metrics.jsonl keeps it)."""
        if "loss" in logs:
            for key, values in self._rollout_metrics.items():
                valid = [v for v in values if v == v]
                logs[key] = sum(valid) / len(valid) if valid else None
            for name, n in self._skipped.items():
                logs[f"rewards/{name}/skipped"] = n
            self._rollout_metrics.clear()
            if self._table:  # (TRL: every logged step shows the last generation's table)
                logs["completions"] = self._table
        if any(v is None for v in logs.values()):
            warnings.warn("GRPO: a rollout metric had no finite value in this window.", stacklevel=2)
            logs = {k: v for k, v in logs.items() if v is not None}
        self._log_eval_rollout(logs)
        super().log(logs, start_time)
