"""What the model is: Whisper modules, weights (HF and CTranslate2), tokenizer, audio front end, loading."""
