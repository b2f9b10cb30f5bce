"""hf_ddpfix: DDP/FSDP-safe fine-tuning with the HF Trainer (public API only)."""
