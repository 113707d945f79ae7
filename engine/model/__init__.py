"""The model: configuration, finding and converting weights, and the Llama-family decoder."""
