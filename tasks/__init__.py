"""The task the policy learns: the synthetic arithmetic task (problems, worked solutions, the
exact step check), the prompt formats, and the final-answer grading (never `eval`)."""
