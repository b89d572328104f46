"""The trainer: FSDP2 model code, the default loss, the RL loop (`asyncrl trainer`) and SFT (`asyncrl sft`)."""
