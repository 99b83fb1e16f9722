"""kvstrata.kernels"""
