"""Trainers: the GRPO and SFT update on a LoRA, with transformers + peft or with Unsloth."""
