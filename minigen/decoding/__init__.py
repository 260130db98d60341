"""From logits to text (chapter "Decoding"): penalties, logit bias and the structured-output token
mask, applied to each row's logits before it samples. guide.py is the structured-output interface;
minigen's own automaton and llguidance implement it."""
