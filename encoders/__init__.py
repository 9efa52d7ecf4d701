"""
encoders: the encoders DeCLUTR can train besides the paper's BERT and RoBERTa (model.py), one a module, each built by
model.py where a config.json asks for it, from model.py's shared pieces handed in. It imports no method file.

    modernbert.py   ModernBERT (Warner et al., 2024): its embeddings, pre-norm layers, rotary positions, local
                    attention, gated feed-forward, and its tensors' names in a Hugging Face checkpoint
"""
