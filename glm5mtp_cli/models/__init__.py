"""The model families (glm5, glm5_next), each behind core/family.ModelFamily; core/families.py selects one
by config.json's model_type."""
