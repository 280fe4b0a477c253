"""Task families: prompts, answers, rewards and the goal check, one file each."""
