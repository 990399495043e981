// Placeholder until the models library has sources.
namespace faceshard { int models_placeholder = 0; }
