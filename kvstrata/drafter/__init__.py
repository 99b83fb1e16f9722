"""kvstrata.drafter"""
