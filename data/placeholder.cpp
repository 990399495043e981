// Placeholder until the data library has sources.
namespace faceshard { int data_placeholder = 0; }
