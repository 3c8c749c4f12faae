"""A trained model from a checkpoint or a Hugging Face directory, on N ranks, and text from a prompt.
Imports config, launch, models, parallel, data, checkpoint and hf.
"""
