"""The MoE decoder (plain PyTorch: decoder.py), its checkpoint loader (loader.py) and the tokenizer. Import the
module you need: the package itself loads nothing, so a router can read the tokenizer without torch."""
