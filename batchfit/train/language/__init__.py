"""Language models: text corpora and a small GPT, and Hugging Face causal language models
with LoRA adapters through peft."""
