"""Process supervision: steps and their token positions, Math-Shepherd automatic step labels."""
